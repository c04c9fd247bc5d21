#!/bin/bash
# stratkit on Slurm: copy this file, change the resources and the last line, then
#   sbatch slurm_sbatch.sh [arguments for train.py]
# Each task runs train.py; stratkit.Trainer() / stratkit.make_strategy() reads the step's
# SLURM_* variables and builds MultiWorkerMirroredStrategy across the tasks (the tasks of a
# node listen on ports 8888, 8889, ...; STRATKIT_SLURM_PORT moves them).
#SBATCH --job-name=stratkit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=stratkit-%j.out

srun python train.py "$@"
