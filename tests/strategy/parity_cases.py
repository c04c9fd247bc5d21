"""Tiny Keras scripts whose numbers one process and N replicas must agree on (run by test_global_gradient.py).

Usage: python parity_cases.py MODE CASE[,CASE...]
MODE: one | mirrored (2 logical CPUs) | mirrored4 (4 logical CPUs) | mwms (TF_CONFIG)
Prints one line `RESULT {json}`: per case the weights, the history and what else the case checks.
Each case is the smallest script that shows one way a replica's loss can fail to become one process's
gradient: which rows (fit's own shuffling of arrays), counts (uneven batch, empty shard, masks, weights), clipping, scalar losses, loss scaling
(and its float16 headroom), accumulation, BatchNorm, custom metrics and a custom train_step; then models without call() (Keras's DCGAN example
in small) and random draws (Dropout, an augmentation layer, keras.random under a SeedGenerator); and the logged
per-output and `sum` losses.
A case's `per_mode` entry holds what must not equal one process (random paths, comparisons with plain Keras): the
workers still agree on it bit for bit.
"""

import contextlib
import json
import logging
import os
import sys

import stratkit

MODE, CASES = sys.argv[1], sys.argv[2].split(",")
# One Trainer, created first (a multi-worker strategy must exist before any TensorFlow op); the model.fit
# cases use its strategy, the Trainer case the Trainer itself.
trainer = {"one": lambda: stratkit.Trainer(strategy="one_device"),
           "mirrored": lambda: stratkit.Trainer(strategy="mirrored", logical_cpus=2),
           "mirrored4": lambda: stratkit.Trainer(strategy="mirrored", logical_cpus=4)}.get(MODE, stratkit.Trainer)()
strategy = trainer.strategy

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import input_cases  # noqa: E402 - issue 39's input forms, run here at no extra process start


def scope():
    return strategy.scope()


def dense(n_in, optimizer, loss="mse", **compile_kwargs):
    """Dense(1, no bias, zeros) compiled with `optimizer()` (and `metrics()`) made in the strategy's scope."""
    with scope():
        model = keras.Sequential([keras.Input((n_in,)),
                                  keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        compile_kwargs = {k: v() if callable(v) and k == "metrics" else v for k, v in compile_kwargs.items()}
        model.compile(optimizer=optimizer(), loss=loss, **compile_kwargs)   # metrics made in the scope
    return model


def fit(model, x, y, batch_size, epochs=1, shuffle_=False, **kwargs):
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=shuffle_, verbose=0, **kwargs)
    return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "h": history.history}


ONES = lambda n: np.ones((n, 1), "float32")  # noqa: E731
EYE = lambda n: np.eye(n, dtype="float32")  # noqa: E731


class Total(keras.metrics.Metric):
    """A custom metric as the keras.metrics.Metric docs write one: result() returns the state variable."""

    def __init__(self, name="total", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(y_pred))

    def result(self):
        return self.total


class GuideModel(keras.Model):
    """train_step as Keras's "customizing what happens in fit()" guide writes it."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class AddedLoss(keras.layers.Layer):
    """A layer that adds a loss in call(), as a VAE's sampling layer adds its KL term."""

    def call(self, x):
        self.add_loss(0.3 * keras.ops.mean(keras.ops.square(x)))
        return x


class MeanLossModel(keras.Model):
    """compute_loss overridden as its docstring shows: a plain mean, no Keras loss object."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred - y))


class TinyGAN(keras.Model):
    """Keras's DCGAN example in small: no call(), a generator and a discriminator as attributes, compile() with two
    optimizers, loss trackers as metrics. `latent(real)` gives the generator's input rows."""

    def __init__(self, latent):
        super().__init__()
        init = lambda seed: keras.initializers.GlorotUniform(seed=seed)  # noqa: E731
        self.discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu", kernel_initializer=init(1)),
                                               keras.layers.Dense(1, kernel_initializer=init(2))])
        self.generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, "relu", kernel_initializer=init(3)),
                                           keras.layers.Dense(4, kernel_initializer=init(4))])
        self.latent = latent
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker, self.g_loss_tracker = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real):
        rows = keras.ops.shape(real)[0]
        fake = self.generator(self.latent(self, real))
        labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(keras.ops.concatenate([fake, real], axis=0)))
        self.d_optimizer.apply(tape.gradient(d_loss, self.discriminator.trainable_weights),
                               self.discriminator.trainable_weights)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(keras.ops.zeros((rows, 1)), self.discriminator(self.generator(self.latent(self, real))))
        self.g_optimizer.apply(tape.gradient(g_loss, self.generator.trainable_weights), self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


LATENT = {"gan_exact": lambda gan, real: keras.ops.tanh(real[:, :3]),    # no randomness: exact on N replicas
          "dcgan": lambda gan, real: keras.random.normal((keras.ops.shape(real)[0], 3), seed=gan.seed_generator)}


def train_gan(name, in_scope=True):
    keras.utils.set_random_seed(1)
    with scope() if in_scope else contextlib.nullcontext():
        gan = TinyGAN(LATENT[name])
        gan.compile(keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2),
                    keras.losses.BinaryCrossentropy(from_logits=True))
        # its two optimizers are built by their first apply (keras_compat/optimizer_build.py), as the example does
    real = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    history = gan.fit(real, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [float(v) for w in gan.get_weights() for v in np.ravel(w)], history.history


class TinyVAE(keras.Model):
    """Keras's VAE example in small, without its random sampling (the decoder reads z_mean): no call(), an encoder
    and a decoder as attributes, loss trackers, the compiled optimizer applied in train_step."""

    def __init__(self):
        super().__init__()
        init = lambda seed: keras.initializers.GlorotUniform(seed=seed)  # noqa: E731
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, "relu", kernel_initializer=init(1))(inputs)
        self.encoder = keras.Model(inputs, [keras.layers.Dense(2, kernel_initializer=init(2))(hidden),
                                            keras.layers.Dense(2, kernel_initializer=init(3))(hidden)])
        self.decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, "relu", kernel_initializer=init(4)),
                                         keras.layers.Dense(6, kernel_initializer=init(5))])
        self.trackers = [keras.metrics.Mean(name=n) for n in ("total_loss", "reconstruction_loss", "kl_loss")]

    @property
    def metrics(self):
        return self.trackers

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var = self.encoder(data)
            reconstruction = keras.ops.mean(keras.ops.sum(keras.ops.square(data - self.decoder(z_mean)), axis=1))
            kl = keras.ops.mean(keras.ops.sum(-0.5 * (1 + z_log_var - keras.ops.square(z_mean)
                                                      - keras.ops.exp(z_log_var)), axis=1))
            total = reconstruction + kl
        self.optimizer.apply_gradients(zip(tape.gradient(total, self.trainable_weights), self.trainable_weights))
        for tracker, value in zip(self.trackers, (total, reconstruction, kl)):
            tracker.update_state(value)
        return {m.name: m.result() for m in self.metrics}


def train_vae(with_trainer=True):
    def build():
        vae = TinyVAE()
        vae.compile(optimizer=keras.optimizers.Adam(1e-2))
        return vae

    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    if with_trainer:    # through stratkit.Trainer, its strategy's scope and fit
        vae = trainer.build(build)
        history = trainer.fit(vae, x, epochs=2, global_batch_size=8, shuffle=False, verbose=0)
    else:               # Keras without a strategy
        vae = build()
        history = vae.fit(x, epochs=2, batch_size=8, shuffle=False, verbose=0)
    history.history.pop("examples_per_sec", None)
    return [float(v) for w in vae.get_weights() for v in np.ravel(w)], history.history


class Noise(keras.layers.Layer):
    """x + keras.random.normal under the layer's own SeedGenerator."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        return x + keras.random.normal(keras.ops.shape(x), seed=self.seed_generator)


def distinct_draws():
    """For 64 identical rows, twice: how many distinct rows Dropout, RandomTranslation and keras.random.normal give
    over the global batch (one process: 128 each), whether one device draws Keras's own bits, and the generators'
    states (every replica's copy, which must advance as one process's)."""
    with scope():
        layers = {"dropout": keras.layers.Dropout(0.5, seed=3), "normal": Noise(),
                  "translation": keras.layers.RandomTranslation(0.4, 0.4, fill_mode="constant", seed=5)}
    rows = {"dropout": np.ones((64, 32), "float32"), "normal": np.ones((64, 4), "float32"),
            "translation": np.tile(np.arange(36, dtype="float32").reshape(1, 6, 6, 1), (64, 1, 1, 1))}
    distinct, drawn = {}, {}
    for kind, layer in layers.items():
        batches = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(rows[kind]).batch(64).repeat(2))
        step = tf.function(lambda x: strategy.gather(strategy.run(lambda v: layer(v, training=True), args=(x,)), 0))
        drawn[kind] = np.concatenate([step(x).numpy().reshape(64, -1) for x in batches])
        distinct[kind] = len({row.tobytes() for row in drawn[kind]})
    plain = Noise()      # the same generator outside any strategy: Keras's own bits
    plain_rows = np.concatenate([(plain(rows["normal"]) - 1.0).numpy() for _ in range(2)])
    states = {kind: [[int(v) for v in np.ravel(copy)] for value in vars(layer).values()
                     if isinstance(value, keras.random.SeedGenerator)
                     for copy in strategy.experimental_local_results(value.state.value)]
              for kind, layer in layers.items()}
    return distinct, states, bool(np.array_equal(drawn["normal"] - 1.0, plain_rows))


def dropout_fit():
    keras.utils.set_random_seed(1)
    with scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, kernel_initializer="ones"),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return fit(model, np.ones((16, 8), "float32"), ONES(16), 8, epochs=2)["w"]


def distributed_batches(x, y, global_batch):
    return strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))


class RowCount(keras.layers.Layer):
    """Counts the rows its calls see, summed over the replicas: one process's count when each row is seen once."""

    def build(self, input_shape):
        self.rows = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="sum", name="rows")

    def call(self, x):
        # TensorFlow's own assign_add: Keras's is assign(self + delta), which a "sum" variable would sum N times
        self.rows.value.assign_add(tf.cast(tf.shape(x)[0], "float32"))
        return x


def on_batch():
    with scope():
        counter = RowCount()
        model = keras.Sequential([keras.Input((7,)), counter,
                                  keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    x = EYE(7) * np.arange(1, 8, dtype="float32")[:, None]
    out = {"train": [model.train_on_batch(x, ONES(7), return_dict=True) for _ in range(2)],
           "test": model.test_on_batch(x, 2 * ONES(7), return_dict=True),
           "predict": [float(v) for v in np.ravel(model.predict_on_batch(np.arange(37 * 7, dtype="float32").reshape(37, 7) / 100))]}
    # 3 rows: fewer than 4 replicas (one gets none), split 2 + 1 on 2
    out["train_few"] = model.train_on_batch(x[4:], 3 * ONES(3), return_dict=True)
    out["predict_few"] = [float(v) for v in np.ravel(model.predict_on_batch(x[:3] / 7))]
    out["rows"] = float(counter.rows.numpy())      # 7 + 7 + 7 + 37 + 3 + 3 when every row is computed once
    out["w"] = [float(v) for w in model.get_weights()[1:] for v in np.ravel(w)]
    return out


def custom_loop():
    """The tutorial's loop as written: Adam made in the scope, never built before `strategy.run`."""
    global_batch = 4
    with scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, kernel_initializer="ones"),
                                  keras.layers.Dense(1, kernel_initializer="ones")])
        loss_object = keras.losses.MeanSquaredError(reduction=None)
        optimizer = keras.optimizers.Adam(0.01)

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

    x, y = EYE(8) * np.arange(1, 9, dtype="float32")[:, None] / 8, ONES(8)
    losses = [float(distributed_train_step(batch)) for _ in range(2) for batch in distributed_batches(x, y, global_batch)]
    return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "losses": losses,
            "iterations": int(optimizer.iterations.numpy())}


def gan_loop():
    """Two models trained in one replica step by two optimizers (a GAN's shape), neither built beforehand."""
    global_batch = 4
    with scope():
        generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, kernel_initializer="ones")])
        discriminator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
        g_optimizer, d_optimizer = keras.optimizers.Adam(0.01), keras.optimizers.RMSprop(0.01)
        bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)

    def train_step(inputs):
        latent, real = inputs
        with tf.GradientTape() as tape:
            fake = generator(latent)
            scores = discriminator(tf.concat([fake, real], axis=0))
            labels = tf.concat([tf.zeros_like(scores[: tf.shape(fake)[0]]), tf.ones_like(scores[tf.shape(fake)[0]:])], 0)
            d_loss = tf.nn.compute_average_loss(bce(labels, scores), global_batch_size=2 * global_batch)
        grads = tape.gradient(d_loss, discriminator.trainable_variables)
        d_optimizer.apply_gradients(zip(grads, discriminator.trainable_variables))
        with tf.GradientTape() as tape:
            scores = discriminator(generator(latent))
            g_loss = tf.nn.compute_average_loss(bce(tf.ones_like(scores), scores), global_batch_size=global_batch)
        grads = tape.gradient(g_loss, generator.trainable_variables)
        g_optimizer.apply_gradients(zip(grads, generator.trainable_variables))
        return d_loss, g_loss

    @tf.function
    def distributed_train_step(batch):
        return [strategy.reduce("SUM", loss, axis=None) for loss in strategy.run(train_step, args=(batch,))]

    # fixed "noise": the loop itself is under test here, not the random draws
    latent = np.linspace(-1, 1, 16, dtype="float32").reshape(8, 2)
    real = np.linspace(0, 2, 24, dtype="float32").reshape(8, 3)
    losses = [[float(v) for v in distributed_train_step(batch)]
              for _ in range(2) for batch in distributed_batches(latent, real, global_batch)]
    return {"w": [float(v) for m in (generator, discriminator) for w in m.get_weights() for v in np.ravel(w)],
            "losses": losses, "iterations": [int(o.iterations.numpy()) for o in (g_optimizer, d_optimizer)]}


def spread(variables):
    """How far the replicas' own copies of `variables` are apart (0.0: every replica holds the same values)."""
    copies = [[np.ravel(np.asarray(c.numpy(), "float64")) for c in strategy.experimental_local_results(v.value)]
              for v in variables]
    return float(max(np.abs(c - cs[0]).max(initial=0.0) for cs in copies for c in cs))


def loop_accumulation():
    """A custom loop with gradient_accumulation_steps=3 whose replicas' gradients differ (each its own rows):
    every replica's copy of the kernel must move by the all-reduced gradient, as on one process. And Keras's own
    optimizer_distribute_test feeds one gradient tensor to every replica: it must be summed over the replicas."""
    global_batch = 4
    with scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False,
                                                                        kernel_initializer="zeros")])
        optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
        loss_object = keras.losses.MeanSquaredError(reduction=None)

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

    x, y = EYE(4) * np.arange(1, 5, dtype="float32")[:, None], np.arange(1, 5, dtype="float32")[:, None]
    losses = [float(distributed_train_step(batch)) for _ in range(3) for batch in distributed_batches(x, y, 2)]
    out = {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "losses": losses,
           "iterations": int(optimizer.iterations.numpy()), "copies_spread": spread(model.trainable_variables)}
    # Keras's own test, eagerly: one tensor shared by every replica, 3 steps of accumulation, lr 1
    with scope():
        shared = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
        grads = keras.ops.convert_to_tensor([[1.0, 1.0], [2.0, 2.0]])
        sgd = keras.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=3)
        for _ in range(3):
            strategy.run(lambda: sgd.apply_gradients([(grads, shared)]))
    out["per_mode"] = {"shared_moved": [float(v) for v in np.ravel(np.array([[1.0, 2.0], [3.0, 4.0]]) - shared.numpy())],
                       "shared_spread": spread([shared])}
    return out


class RunningMean(keras.layers.Layer):
    """Keras's "making new layers" guide: state kept with add_weight(trainable=False) (Keras's default aggregation,
    "none") and assigned in call(): a running mean of the rows, and an integer step counter."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False, name="mean")
        self.steps = self.add_weight(shape=(), initializer="zeros", trainable=False, dtype="int32", name="steps")

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.8 * self.mean + 0.2 * keras.ops.mean(x, axis=0))
            self.steps.assign_add(1)
        return x - self.mean


def running_mean(rows):
    """The running-mean layer in front of a Dense, `rows` rows at global batch 4 (7: the last batch 2 + 1 on 2
    replicas, 1 + 1 + 1 + 0 on 4)."""
    with scope():
        layer = RunningMean(name="running")
        model = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    notices = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: notices.append(record.getMessage())
    logging.getLogger("stratkit").addHandler(handler)
    x = np.arange(rows * 3, dtype="float32").reshape(rows, 3) / (rows * 3)
    try:
        out = fit(model, x, np.arange(rows, dtype="float32").reshape(rows, 1) / rows, 4, epochs=2)
    finally:
        logging.getLogger("stratkit").removeHandler(handler)
    out["state"] = [float(v) for v in np.ravel(layer.mean.numpy())] + [int(layer.steps.numpy())]
    out["evaluate"] = model.evaluate(x, np.ones((rows, 1), "float32"), batch_size=4, verbose=0, return_dict=True)
    out["copies_spread"] = spread([layer.mean, layer.steps])
    out["per_mode"] = {"notice": [n for n in notices if "running/mean" in n]}
    return out


def planted_divergence():
    """The running-mean layer with stratkit told to leave its state alone (STRATKIT_REPLICA_STATE=keep): each
    replica keeps its own mean. The replica check must stop fit at the first epoch's end, before ModelCheckpoint
    writes, naming the variable; a custom loop's stratkit.check_replicas() and warn mode say the same."""
    import tempfile

    os.environ["STRATKIT_REPLICA_STATE"] = "keep"
    try:
        with scope():
            layer = RunningMean(name="running")
            model = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1, kernel_initializer="ones")])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        target = os.path.join(tempfile.mkdtemp(prefix="planted-"), "model.keras")
        x = np.arange(24, dtype="float32").reshape(8, 3) / 24
        raised = None
        try:
            fit(model, x, np.ones((8, 1), "float32"), 4, epochs=2, callbacks=[keras.callbacks.ModelCheckpoint(target)])
        except stratkit.ReplicaDivergenceError as exc:
            raised = str(exc)
        out = {"per_mode": {"raised": raised, "saved": os.path.exists(target), "epochs_done": int(layer.steps.numpy())}}
        try:                        # the custom loop's own check, on the same diverged model
            stratkit.check_replicas(model)
            out["per_mode"]["check_replicas"] = None
        except stratkit.ReplicaDivergenceError as exc:
            out["per_mode"]["check_replicas"] = str(exc)
        os.environ["STRATKIT_REPLICA_CHECK"] = "warn"
        notices = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: notices.append(record.getMessage())
        logging.getLogger("stratkit").addHandler(handler)
        try:
            fit(model, x, np.ones((8, 1), "float32"), 4, epochs=1)
        finally:
            logging.getLogger("stratkit").removeHandler(handler)
            del os.environ["STRATKIT_REPLICA_CHECK"]
        out["per_mode"]["warned"] = [n for n in notices if "no longer hold the same model" in n]
        # Trainer.fit with step backups: the check before the first backup stops the run, nothing is written
        with scope():
            layer = RunningMean(name="running")
            model = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1, kernel_initializer="ones")])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        backup = tempfile.mkdtemp(prefix="planted-backup-")
        try:
            trainer.fit(model, (x, np.ones((8, 1), "float32")), epochs=1, global_batch_size=4, shuffle=False,
                        backup_dir=backup, backup_every=1, verbose=0)
            out["per_mode"]["backup_raised"] = None
        except stratkit.ReplicaDivergenceError as exc:
            out["per_mode"]["backup_raised"] = str(exc).split(": ")[0]
        out["per_mode"]["backup_files"] = sorted(n for n in os.listdir(backup) if n.endswith(".h5")) \
            if os.path.isdir(backup) else []
        return out
    finally:
        del os.environ["STRATKIT_REPLICA_STATE"]


def diverged_before_fit():
    """Copies that differ before fit starts: on 2 workers the chief alone loads other weights (`if is_chief:
    model.load_weights(...)`), on Mirrored one device's copy is moved by hand. The replica check stops a plain
    model.fit and Trainer.fit before their first step. Loading on every worker is fine; a Trainer.fit resumed
    from a backup is checked after the backup loaded (which makes the chief's other weights moot: no alarm),
    and on 2 workers a backup whose copies differ (worker 1's rewritten) stops the resumed fit before its step."""
    import tempfile

    from stratkit.training.checkpoint import find_resume_point, worker_backup_dir, write_backup

    x, y = np.arange(48, dtype="float32").reshape(16, 3) / 48, ONES(16)   # 4 steps of 4 rows
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="zeros")])  # no strategy
    weights = os.path.join(tempfile.mkdtemp(prefix="other-"), "other.weights.h5")
    other.save_weights(weights)
    steps = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(batch))

    def build():
        with scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    def plant(model):
        if MODE == "mwms" and trainer.is_chief:
            model.load_weights(weights)
        elif MODE.startswith("mirrored"):
            copies = model.layers[0].kernel.value.values     # one device's copy, moved by hand
            copies[1].assign(copies[1] + 1.0)
        return model

    def attempt(run, **kwargs):
        del steps[:]
        try:
            run(callbacks=[counter], verbose=0, **kwargs)
            return {"raised": None, "steps": len(steps)}
        except stratkit.ReplicaDivergenceError as exc:
            return {"raised": str(exc), "steps": len(steps)}

    class FailAt(keras.callbacks.Callback):
        """Every worker fails at global step 2, after the backup there: a run that left its backups."""

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("stopped at step 2")

    def interrupted():
        backup, model = tempfile.mkdtemp(prefix="resume-"), build()
        try:
            trainer.fit(model, (x, y), epochs=1, global_batch_size=4, shuffle=False, backup_dir=backup,
                        backup_every=1, callbacks=[FailAt()], verbose=0)
        except RuntimeError:
            pass
        return backup

    def resume(backup, model):
        return attempt(lambda **kw: trainer.fit(model, (x, y), epochs=1, global_batch_size=4, shuffle=False,
                                                backup_dir=backup, backup_every=1, **kw))

    out = {"model_fit": attempt(lambda **kw: plant(build()).fit(x, y, batch_size=4, epochs=1, shuffle=False, **kw)),
           "trainer": attempt(lambda **kw: trainer.fit(plant(build()), (x, y), epochs=1, global_batch_size=4,
                                                       shuffle=False, **kw))}
    everywhere = build()
    everywhere.load_weights(weights)
    out["loaded_everywhere"] = attempt(lambda **kw: everywhere.fit(x, y, batch_size=4, epochs=1, shuffle=False, **kw))
    out["resumed"] = resume(interrupted(), plant(build()))
    if MODE == "mwms":          # worker 1's copy of the backup rewritten with other weights (its check off)
        backup, model = interrupted(), build()
        if not trainer.is_chief:
            own = worker_backup_dir(backup, False, 1)
            point = find_resume_point(own)
            model.load_weights(weights)
            os.environ["STRATKIT_REPLICA_CHECK"] = "off"
            write_backup(model, own, point.position, point.state(), point.arrays(), keep=2)
            del os.environ["STRATKIT_REPLICA_CHECK"]
        out["diverged_backup"] = resume(backup, build())
    return {"per_mode": out}


def case(name):
    if name in input_cases.CASES:
        return input_cases.case(name, MODE, trainer, strategy)
    if name in LATENT:
        w, h = train_gan(name)
        if name == "gan_exact":
            out = {"w": w, "h": h, "per_mode": {}}
        else:                       # random latent rows: each replica its own, so not one process's path
            out = {"finite": bool(np.isfinite(w).all()), "per_mode": {"w": w, "h": h}}
        if MODE == "one":           # stratkit's one-device choice against Keras without a strategy
            out["per_mode"]["plain_gap"] = float(np.max(np.abs(np.subtract(w, train_gan(name, in_scope=False)[0]))))
        return out
    if name == "vae_exact":
        w, h = train_vae()
        out = {"w": w, "h": h, "per_mode": {}}
        if MODE == "one":
            out["per_mode"]["plain_gap"] = float(np.max(np.abs(np.subtract(w, train_vae(with_trainer=False)[0]))))
        return out
    if name == "loop_accumulation":
        return loop_accumulation()
    if name == "planted_divergence":
        return planted_divergence()
    if name == "diverged_before_fit":
        return diverged_before_fit()
    if name in ("running_mean", "running_mean_uneven"):
        return running_mean(8 if name == "running_mean" else 7)
    if name == "random_draws":
        distinct, states, keras_bits = distinct_draws()
        first = dropout_fit()
        return {"distinct": distinct, "same_seed_same_weights": first == dropout_fit(),
                "states": {kind: copies[0] for kind, copies in states.items()},
                "copies_spread": max(abs(a - b) for copies in states.values() for c in copies
                                     for a, b in zip(c, copies[0])),
                "per_mode": {"w": first, "keras_bits": keras_bits}}

    keras.utils.set_random_seed(1)
    sgd = lambda lr=0.1, **kw: (lambda: keras.optimizers.SGD(lr, **kw))  # noqa: E731
    if name == "uneven":            # 7 rows, global batch 4: the last batch has 3 rows (2 + 1)
        return fit(dense(7, sgd(), metrics=["mae"]), EYE(7), ONES(7), 4, epochs=2)
    if name == "empty_shard":       # 5 rows, batch 4: one replica's last shard is empty
        return fit(dense(5, sgd()), EYE(5), ONES(5), 4, epochs=2)
    if name in ("shuffled", "shuffled_batch"):   # fit's default shuffle=True on arrays, no seed set
        tf.random.set_seed(None)    # no global seed: Keras draws each epoch's order per process
        shuffle = True if name == "shuffled" else "batch"
        # one-hot rows: a row's weight moves only when the row is trained, so the weights say how often each
        # row was used (one process: once an epoch, whatever the order)
        return fit(dense(8, sgd(0.4)), EYE(8), ONES(8), 4, epochs=3, shuffle_=shuffle)
    if name == "added_losses":      # losses layers add in call(): an activity regularizer and add_loss
        # Keras 3.14+ divides an activity regularizer by the batch's rows (a mean, exact on an even split);
        # 3.11-3.13 add the sum over the rows, which N replicas count 1/N of, as Keras does (documented)
        activity = {"activity_regularizer": keras.regularizers.l2(0.5)} if tuple(
            int(p) for p in keras.__version__.split(".")[:2]) >= (3, 14) else {}
        with scope():
            model = keras.Sequential([keras.Input((6,)),
                                      keras.layers.Dense(2, use_bias=False, kernel_initializer="ones", **activity),
                                      AddedLoss(),
                                      keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                                         kernel_regularizer=keras.regularizers.l2(0.01))])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        # what model.losses lists between steps and after fit: one process's count (add_loss, the regularizers)
        listed = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: counts.append(len(model.losses)))
        counts = []
        # 7 rows, batch 4: the last batch splits 2 + 1 on 2 replicas and 1 + 1 + 1 + 0 on 4, where AddedLoss's
        # mean over no rows is NaN on the empty replica. A replica's added losses weigh its share of the rows
        # (before: 1/N each, 1.7e-2 off one process on 2 replicas, NaN logs on 4)
        x = np.concatenate([EYE(6), 0.5 * EYE(6)[:1]])
        out = fit(model, x, ONES(7), 4, epochs=2, callbacks=[listed])
        out["evaluate"] = float(model.evaluate(x, ONES(7), batch_size=4, verbose=0))
        out["losses_listed"] = counts + [len(model.losses)]
        return out
    if name == "regularized_empty_shard":   # a weight regularizer, and one replica without rows
        with scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(
                1, use_bias=False, kernel_initializer="ones", kernel_regularizer=keras.regularizers.l2(0.5))])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mse"])
        x = np.arange(25, dtype="float32").reshape(5, 5) / 25
        out = fit(model, x, ONES(5), 4, epochs=2)
        out["evaluate"] = model.evaluate(x, ONES(5), batch_size=4, verbose=0, return_dict=True)
        return out
    if name == "masked":
        with scope():
            model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                      keras.layers.Embedding(5, 1, mask_zero=True, embeddings_initializer="zeros")])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return fit(model, np.array([[1, 2, 3], [4, 0, 0]], "int32"), np.ones((2, 3, 1), "float32"), 2)
    if name == "weighted_mean":
        loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
        return fit(dense(4, sgd(), loss=loss), EYE(4), ONES(4), 4, sample_weight=np.arange(1, 5, dtype="float32"))
    if name in ("global_clipnorm", "clipnorm"):
        return fit(dense(4, sgd(1.0, **{name: 0.1})), EYE(4), ONES(4), 4)
    if name == "clipvalue":
        return fit(dense(2, sgd(1.0, clipvalue=0.3)), np.ones((4, 2), "float32"), ONES(4), 4)
    if name == "scalar_loss":       # the user's loss returns its batch mean as one scalar
        return fit(dense(4, sgd(), loss=lambda t, p: tf.reduce_mean(tf.square(t - p))), EYE(4), ONES(4), 4, epochs=2)
    if name == "compute_loss":       # an even split: the plain mean of each replica's half is one process's
        with scope():
            inputs = keras.Input((4,))
            model = MeanLossModel(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
            model.compile(optimizer=keras.optimizers.SGD(0.1))
        return fit(model, EYE(4), ONES(4), 4, epochs=2)
    if name == "accumulation":
        return fit(dense(4, sgd(gradient_accumulation_steps=2)), EYE(4), ONES(4), 2, epochs=2)
    if name == "custom_metric":
        return fit(dense(7, sgd(), metrics=lambda: [Total(), "mae"]), EYE(7), ONES(7), 4, epochs=2)
    if name == "train_step":
        with scope():
            inputs = keras.Input((4,))
            model = GuideModel(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        return fit(model, EYE(4), ONES(4), 4, epochs=2)
    if name in ("batchnorm", "batchnorm_exact"):   # exact: the global batch's moments (STRATKIT_SYNC_BATCHNORM=1)
        os.environ["STRATKIT_SYNC_BATCHNORM"] = "1" if name == "batchnorm_exact" else "0"
        with scope():
            # Keras's fine-tuning recipe: a base called with training=False, left trainable, so its
            # BatchNormalization trains anyway (keras-team/keras#20285); the fit-start notice names it
            base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, kernel_initializer="ones"),
                                     keras.layers.BatchNormalization(name="base_bn")], name="base")
            inputs = keras.Input((3,))
            model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(base(inputs, training=False)))
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        notices = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: notices.append(record.getMessage())
        logging.getLogger("stratkit").addHandler(handler)
        rng = np.random.default_rng(0)
        try:
            out = fit(model, rng.normal(size=(60, 3)).astype("float32"), rng.normal(size=(60, 1)).astype("float32"),
                      16, epochs=2)
        finally:
            logging.getLogger("stratkit").removeHandler(handler)
        if name == "batchnorm":     # per-replica moments: what the notice at fit's start said
            out["notice"] = [n for n in notices if n.startswith("BatchNormalization on")]
        bn = base.layers[1]
        statistics = [bn.moving_mean, bn.moving_variance]
        out["moving"] = [float(v) for s in statistics for v in np.ravel(s)]
        # how far the replicas' own copies of the statistics are apart (0: every replica holds the same model)
        copies = [[np.ravel(c.numpy()) for c in strategy.experimental_local_results(s.value)] for s in statistics]
        out["copies_spread"] = float(max(np.abs(c - cs[0]).max() for cs in copies for c in cs))
        out["predict"] = [float(v) for v in np.ravel(model.predict(np.eye(3, dtype="float32"), verbose=0))]
        return out
    if name == "loss_scaling":      # mixed_float16: the first batch overflows on the second replica's half only
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            with scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False,
                                                                                kernel_initializer="ones")])
                model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3),
                                                                            initial_scale=2.0 ** 8), loss="mse")
            x = np.ones((16, 4), "float32")
            x[6:8] = 3e3
            scales = []
            record = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: scales.append(float(model.optimizer.dynamic_scale.value.numpy())))
            out = fit(model, x, ONES(16), 8, epochs=2, callbacks=[record])
            out["scales"] = scales
            return out
        finally:
            keras.mixed_precision.set_global_policy("float32")
    if name == "loss_scale_headroom":   # mixed_float16: a row's float16 gradient has one process's size
        # pred - y = 1.5 on every row: one process's float16 gradient of a row's output is scale * 3/8, finite up
        # to scale 2**17; one at N times that size overflows from scale 2**17 / N (the kernel's gradient, a sum
        # of rows times 1/16, stays finite either way). The scale must settle where one process's does.
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            with scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False,
                                                                                kernel_initializer="ones")])
                model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.SGD(0.1), initial_scale=2.0 ** 24, dynamic_growth_steps=2), loss="mse")
            scales = []
            record = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: scales.append(float(model.optimizer.dynamic_scale.value.numpy())))
            out = fit(model, np.full((16, 4), 1 / 16, "float32"), np.full((16, 1), -1.25, "float32"), 8, epochs=8,
                      callbacks=[record])
            out["scales"] = scales
            out["applied_steps"] = int(model.optimizer.iterations.numpy())
            return out
        finally:
            keras.mixed_precision.set_global_policy("float32")
    if name == "output_losses":     # two outputs, 7 rows, batch 4: the last batch splits 2 + 1 rows
        with scope():
            inputs = keras.Input((7,))
            model = keras.Model(inputs, {"a": keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                                 name="a")(inputs),
                                         "b": keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                                 name="b")(inputs)})
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"a": "mse", "b": "mae"})
        x, y = EYE(7), {"a": np.array([[1], [2], [3], [1], [1], [2], [6]], "float32"), "b": ONES(7)}
        out = fit(model, x, y, 4, epochs=2)
        out["evaluate"] = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
        return out
    if name == "sum_loss":          # reduction="sum", 7 rows, batch 4: the last batch splits 2 + 1 rows
        model = dense(7, sgd(0.05), loss=keras.losses.MeanSquaredError(reduction="sum"))
        out = fit(model, EYE(7), np.arange(1, 8, dtype="float32").reshape(7, 1), 4, epochs=2)
        out["evaluate"] = float(model.evaluate(EYE(7), np.arange(1, 8, dtype="float32").reshape(7, 1),
                                               batch_size=4, verbose=0))
        return out
    if name == "on_batch":          # the *_on_batch methods: 7 rows split 4 + 3 (2+2+2+1 on 4), predict 37 and 3 rows
        return on_batch()
    if name == "custom_loop":       # TensorFlow's custom-training-loop tutorial: the optimizer built by its first apply
        return custom_loop()
    if name == "gan_loop":          # a GAN's loop: two models, two optimizers, both built by their first apply
        return gan_loop()
    if name == "trainer_uneven":    # the same uneven batch through stratkit.Trainer
        def build():
            model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(1, use_bias=False,
                                                                            kernel_initializer="zeros")])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            return model

        model = trainer.build(build)
        history = trainer.fit(model, (EYE(7), ONES(7)), epochs=2, global_batch_size=4, shuffle=False, verbose=0)
        return {"w": [float(v) for v in np.ravel(model.get_weights()[0])], "h": history.history}
    import finetune_cases  # issue 46's fine-tuning cases (imported here: scripts that copy this file need not)

    return finetune_cases.case(name, MODE, trainer, strategy)


RESULT = json.dumps({name: case(name) for name in CASES})
if os.environ.get("PARITY_RESULTS"):  # a directory: under stratkit launch (a 2-worker RESULT of every case is ~53 KB,
    # near the 64 KiB the launcher passes on as one line: stratkit/process/pump.py MAX_LINE_BYTES)
    with open(os.path.join(os.environ["PARITY_RESULTS"], f"result-{trainer.spec.task_index}.json"), "w") as out:
        out.write(RESULT)
print("RESULT " + RESULT, flush=True)
