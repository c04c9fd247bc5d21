#!/bin/bash
# stratkit on Slurm, for runs longer than the time limit or on a partition that preempts: copy this file,
# change the resources and the srun line, then
#   sbatch slurm_requeue.sh [arguments for train.py]
# train.py calls Trainer.fit(..., backup_dir=<storage every node reaches: shared, or s3://...>, backup_every=...).
#
# What happens: 300 s (the @300) before the time limit Slurm sends USR1 to this shell (B: = the batch
# shell only, not srun or the tasks). The trap hands it to srun, which hands it to every task; inside a
# Slurm job stratkit takes USR1 as a preemption notice, so every task stops at the same step, writes its
# backup and exits 75. Then this script requeues the job: the same job id comes back with
# SLURM_RESTART_COUNT=1, 2, ... and Trainer.fit resumes at that step. A preemption (Slurm sends the tasks
# SIGTERM at the start of the partition's GraceTime) ends the same way: the tasks exit 75, the job is requeued.
#
# Give the notice room for one step, one backup write and ~30 s more (Slurm checks time limits every 30 s,
# so USR1 comes up to 30 s earlier than asked, never later). A requeued job starts at the earliest
# cred_expire + 1 s (AuthInfo, 120 s by default) after the requeue.
#SBATCH --job-name=stratkit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=stratkit-%j.out

# srun in the background: bash runs a trap only between commands, so `wait` (which a trap interrupts) must
# be what the shell is doing when USR1 comes. srun forwards USR1 to every task (never send it SIGTERM: srun
# answers that with SIGKILL to the tasks).
trap 'echo "stratkit: USR1 at $(date +%T): passed to the tasks"; kill -USR1 "$step" 2>/dev/null' USR1
srun python train.py "$@" &
step=$!
until wait "$step"; status=$?; ! kill -0 "$step" 2>/dev/null; do :; done

if [ "$status" -eq 75 ]; then      # every task wrote its backup and exited 75 (stratkit.status.EXIT_PREEMPTED)
    echo "stratkit: the tasks exited 75 at $(date +%T): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
