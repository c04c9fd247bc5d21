"""Fine-tuning as users write it in 2026 (issue 46): the cases `parity_cases.py` runs for it.

* `callback_objects`: the user's own ModelCheckpoint (and a subclass of it), EarlyStopping, TensorBoard,
  CSVLogger and BackupAndRestore, through `model.fit` and `Trainer.fit`: after `fit` each object holds on every
  worker what it holds on one process (`best`, the files it names, what a subclass noted), while only the chief
  writes files (`per_worker`: what each process's own directory holds; every process writes under a directory
  of its own, so a non-chief's is empty). Before: a private copy trained on worker 1, and `ckpt.best` stayed None.
* `float8`: `model.quantize("float8")` then `fit` (AdamW, 2 Dense layers with biases): the scales, amax
  histories, weights and logs one process's. Before: a history entry 0.158 where one process has 0.085.
* `float8_train_step`: a float8 model whose own `train_step` never calls `optimizer.scale_loss` (Keras's guide
  writes it so): refused before step 1 on N replicas (its output gradients would be N times one process's),
  trained on one.
* `int8_after_training`: a float32 model trained, then `quantize("int8")`, `predict` and `evaluate`.
* `no_gradient`, `no_gradient_float16`: a trainable variable the forward pass does not use, through `model.fit`,
  `Trainer.fit` and a custom `strategy.run` loop (float32), and `model.fit` under `mixed_float16`: trained as one
  process trains it (Keras's warning once, the variable unchanged). Before: step 1 died with `TypeError:
  category must be a Warning subclass, not 'list'`.

Cost in test_global_gradient's fixtures (measured at load 2, each case timed inside its process): one process
6.8 s, Mirrored over 2 CPUs 17.2 s, over 4 CPUs 25.0 s (`FOUR_REPLICAS`), 2 workers 26.3 s: 75 s in all, no
process start of their own.
"""

import os
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf

CASES = ["callback_objects", "float8", "float8_train_step", "int8_after_training", "no_gradient",
         "no_gradient_float16"]
#: float16: the weights within 1e-3 (test_global_gradient.FLOAT16)
FLOAT16 = {"no_gradient_float16"}
#: also on 4 replicas
FOUR_REPLICAS = ["float8", "float8_train_step", "no_gradient", "no_gradient_float16"]

_rng = np.random.default_rng(46)
X = _rng.normal(size=(32, 6)).astype("float32")
Y = (X @ _rng.normal(size=(6, 1)) + 0.2).astype("float32")


def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def _weights(model):
    """Every variable by its place and name (a layer's name counts the models made before it); an amax history
    (1024 entries) by its newest 2 and oldest 6 entries."""
    out = {}
    for i, v in enumerate(model.weights):
        values = np.ravel(np.asarray(v.numpy(), "float64"))
        out[f"{i}:{v.name}"] = [float(x) for x in (np.r_[values[:2], values[-6:]] if values.size > 64 else values)]
    return out


def _history(history):
    return {k: v for k, v in history.history.items() if k != "examples_per_sec"}


# ---------------------------------------------------------------------------------------------
# the user's own callback objects
# ---------------------------------------------------------------------------------------------
class Noting(keras.callbacks.ModelCheckpoint):
    """A user's subclass: notes each epoch's file name, as a script that uploads its checkpoints does."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.noted = []

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.noted.append(self.filepath.format(epoch=epoch + 1))


def _callbacks(out):
    return {"best": keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt", "best.keras"), monitor="val_loss",
                                                    save_best_only=True),
            "noting": Noting(os.path.join(out, "every", "model-{epoch:02d}.weights.h5"), save_weights_only=True),
            "early": keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=1e3),
            "tb": keras.callbacks.TensorBoard(os.path.join(out, "tb"), write_graph=False),
            "csv": keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
            "backup": keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))}


def _held(callbacks, out):
    """What the user's objects hold after fit, paths relative to `out`."""
    def rel(path):
        return os.path.relpath(os.fspath(path), out)

    c = callbacks
    return {"best": c["best"].best, "best_file": rel(c["best"].filepath),
            "noted": [rel(p) for p in getattr(c["noting"], "noted", [])], "noting_file": rel(c["noting"].filepath),
            "early": [c["early"].best, c["early"].best_epoch, c["early"].stopped_epoch, c["early"].wait],
            "tb": [rel(c["tb"].log_dir), rel(getattr(c["tb"], "_train_dir", out))],
            "csv": rel(c["csv"].filename),
            "backup": [rel(c["backup"].backup_dir), rel(c["backup"]._weights_path)]}


def _files(out):
    """What this process wrote under `out` (TensorBoard's event files by directory: their names hold a host)."""
    found = []
    for root, _, names in os.walk(out):
        for name in names:
            path = os.path.relpath(os.path.join(root, name), out)
            found.append(os.path.dirname(path) + "/<events>" if "tfevents" in name else path)
    return sorted(set(found))


def callback_objects(trainer, strategy):
    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, "tanh", kernel_initializer=_init(1)),
                                  keras.layers.Dense(1, kernel_initializer=_init(2))])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    result, files = {}, {}
    for how in ("fit", "trainer"):
        out = tempfile.mkdtemp(prefix=f"callback-objects-{how}-")
        callbacks = _callbacks(out)
        if how == "fit":
            with strategy.scope():
                model = build()
            history = model.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0, validation_data=(X, Y),
                                callbacks=list(callbacks.values()))
        else:
            model = trainer.build(build)
            history = trainer.fit(model, (X, Y), epochs=4, global_batch_size=8, shuffle=False, verbose=0,
                                  validation_data=(X, Y), callbacks=list(callbacks.values()))
        result[how] = {**_held(callbacks, out), "h": _history(history),
                       "w": [float(v) for w in model.get_weights() for v in np.ravel(w)]}
        files[how] = _files(out)
    return {**result, "per_worker": {"files": files}}


# ---------------------------------------------------------------------------------------------
# float8, int8
# ---------------------------------------------------------------------------------------------
def _dense_model(strategy, quantize=None, model_class=keras.Sequential, optimizer=None):
    with strategy.scope():
        layers = [keras.Input((6,)), keras.layers.Dense(8, "relu", kernel_initializer=_init(3)),
                  keras.layers.Dense(1, kernel_initializer=_init(4))]
        if model_class is keras.Sequential:
            model = keras.Sequential(layers)
        else:
            x = layers[0]
            model = model_class(x, layers[2](layers[1](x)))
        if quantize:
            model.quantize(quantize)
        model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-2), loss="mse", metrics=["mae"])
    return model


class GuideModel(keras.Model):
    """train_step as Keras's "customizing what happens in fit()" guide writes it: no optimizer.scale_loss."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def float8(strategy):
    model = _dense_model(strategy, "float8")
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return {"w": _weights(model), "h": _history(history),
            "evaluate": model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)}


def float8_train_step(strategy):
    import stratkit

    model = _dense_model(strategy, "float8", model_class=GuideModel)
    try:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        refused = None
    except stratkit.ConfigError as exc:
        refused = str(exc)
    return {"per_mode": {"refused": refused, "steps": int(model.optimizer.iterations.numpy())}}


def int8_after_training(strategy):
    model = _dense_model(strategy, optimizer=keras.optimizers.SGD(0.05))
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.quantize("int8")      # as Keras's quantization guide does, after training
    return {"predict": [float(v) for v in np.ravel(model.predict(X[:5], verbose=0))],
            "evaluate": model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True),
            "kernel_dtype": [str(v.dtype) for v in model.weights if v.path.endswith("kernel")]}


# ---------------------------------------------------------------------------------------------
# a trainable variable without a gradient
# ---------------------------------------------------------------------------------------------
class Pooled(keras.layers.Layer):
    """A projection and a pooler; the head reads only the projection, so the pooler gets no gradient (a
    backbone's pooler a fine-tuning head skips)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), initializer=_init(5), name="kernel")
        self.pooler = self.add_weight(shape=(4, 4), initializer=_init(6), name="pooler")

    def call(self, x):
        return keras.ops.tanh(x @ self.kernel)


def _unused_model(optimizer=None):
    model = keras.Sequential([keras.Input((6,)), Pooled(name="backbone"),
                              keras.layers.Dense(1, kernel_initializer=_init(7))])
    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse", metrics=["mae"])
    return model


def _caught(run):
    """(what `run()` returns, how many of Keras's "Gradients do not exist" warnings it issued) under Python's
    default filter, which shows a warning once per place."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        value = run()
    return value, sum("Gradients do not exist" in str(w.message) for w in caught)


def _loop(strategy):
    """A custom loop as TensorFlow's tutorial writes it, over the same model."""
    global_batch = 8
    with strategy.scope():
        model = _unused_model()
        loss_object = keras.losses.MeanSquaredError(reduction=None)
        optimizer = keras.optimizers.Adam(1e-2)

    def step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def distributed_step(batch):
        return strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)

    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(global_batch))
    losses = [float(distributed_step(batch)) for _ in range(2) for batch in batches]
    return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "losses": losses}


def no_gradient(trainer, strategy):
    def fit():
        with strategy.scope():
            model = _unused_model()
        pooler = model.layers[0].pooler.numpy().copy()
        history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "h": _history(history),
                "pooler_unchanged": bool(np.array_equal(pooler, model.layers[0].pooler.numpy()))}

    def through_trainer():
        model = trainer.build(_unused_model)
        history = trainer.fit(model, (X, Y), epochs=2, global_batch_size=8, shuffle=False, verbose=0)
        return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "h": _history(history)}

    out, warned = {}, {}
    for name, run in (("fit", fit), ("trainer", through_trainer), ("loop", lambda: _loop(strategy))):
        out[name], warned[name] = _caught(run)
    out["warned"] = warned
    return out


def no_gradient_float16(strategy):
    """With SGD: Adam turns float16's rounding of a split batch into whole steps (see docs/exact.md)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def fit():
            with strategy.scope():
                model = _unused_model(keras.optimizers.SGD(0.05, momentum=0.9))
            # targets small enough that no step's float16 gradient sum overflows: where one does, one process
            # skips a step that N replicas, each summing fewer rows, apply (docs/keras3.md, "Not exact")
            history = model.fit(X, 0.1 * Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "h": _history(history),
                    "applied_steps": int(model.optimizer.iterations.numpy())}

        out, warned = _caught(fit)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    out["warned"] = warned
    return out


def case(name, mode, trainer, strategy):
    if name == "callback_objects":
        return callback_objects(trainer, strategy)
    if name == "float8":
        return float8(strategy)
    if name == "float8_train_step":
        return float8_train_step(strategy)
    if name == "int8_after_training":
        return int8_after_training(strategy)
    if name == "no_gradient":
        return no_gradient(trainer, strategy)
    if name == "no_gradient_float16":
        return no_gradient_float16(strategy)
    raise SystemExit(f"unknown case {name}")
