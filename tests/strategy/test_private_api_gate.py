"""Every private Keras/TensorFlow use of stratkit sits behind the version gate, and is listed here.

The gate modules are the package `stratkit/strategy/keras_compat/` and its
siblings `stratkit/strategy/keras_*.py`: the compat suite proves them per Keras
version, and `keras_compat.apply`/`check_parameter_server` refuse a Keras they
were not proved on. A private use anywhere else would break silently on the
next Keras release, so this test reads every stratkit module with `ast` and
fails, naming file:line, on:

* an import of `keras.src`, `tensorflow.python` or `tf_keras.src` (or that
  module path as a string, as `importlib.import_module` takes it);
* `X._name` (not a dunder) where X is not our own object: `self`/`cls` of a
  class of ours count as ours unless `_name` is inherited from a Keras/TF
  base class; names imported from `stratkit`, and names assigned the result
  of calling one of them, a class of the file or `cls`/`self`, are ours; the few standard
  library and pyspark privates stratkit needs are listed in `ALLOWED`;
  `getattr`/`hasattr`/`setattr`/`delattr(X, "_name")` and `X.__dict__["_name"]`
  the same;
* an assignment (or `setattr`/`delattr`/`del`) on an attribute of a Keras or
  TensorFlow name: a monkey-patch.

The rule is static: a patch through a local alias of a Keras class escapes it
(review catches those); a private name read through one does not.

A second test keeps the inventory of what the gate touches, so a new private
use shows up as a diff of `GATE_INVENTORY` in review.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Files allowed private uses while a move into the gate is under way (none now): a named, temporary
#: exception; the test below fails once an entry is no longer needed.
TEMPORARY_EXCEPTIONS: frozenset[str] = frozenset()

_PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tf_keras.src")
_EXTERNAL_PACKAGES = ("keras", "tensorflow", "tf_keras")
_MODULE_PATH = re.compile(r"^(keras\.src|tensorflow\.python|tf_keras\.src)(\.[A-Za-z_]\w*)*$")
_PRIVATE_NAME = re.compile(r"^_[A-Za-z]\w*$")
_OWN_PREFIX = "_stratkit"  # our own attribute names on foreign objects: any Keras user may set attributes

#: (the accessed object as written, attribute) -> why it is not a Keras/TF private use.
ALLOWED: dict[tuple[str, str], str] = {
    ("os", "_exit"): "stdlib: leave a child process without running the parent's exit handlers",
    ("fluent", "_active_run_stack"): "mlflow (not Keras/TF): the main thread's active run, seen from Spark ML's "
                                     "tuning threads (spark/ml/tracking.py; any failure there falls back to no "
                                     "parent run, tested on the pinned MLflow)",
    ("atexit", "_run_exitfuncs"): "stdlib: run the exit handlers before os._exit in a Spark child",
    ("spark_context", "_jsc"): "pyspark: the JVM SparkContext (slot counts have no Python API)",
    ("df", "_jdf"): "pyspark: the DataFrame's JVM Dataset, whose optimized plan (is it a bare Parquet scan?) has no "
                    "Python API (spark/in_place.py; a DataFrame without one is staged)",
    ("BarrierTaskContext", "_taskContext"): "pyspark: the task context pyspark's own worker sets",
    ("TaskContext", "_taskContext"): "pyspark: the task context pyspark's own worker sets",
    ("formatter", "_fmt"): "stdlib logging: tell absl's bare basicConfig() handler from one the user made",
    ("Params", "_dummy"): "pyspark: the placeholder parent of a Param declared on a class (pyspark.ml's own stages "
                          "and its docs for custom ones)",
    # keras-tuner (not Keras/TF), behind stratkit/tuning/kt_tuner.py's version range (tested on 1.4.8; PRIVATE there)
    ("oracle", "_brackets"): "keras-tuner: Hyperband's brackets, read to tell whether its next trial needs results "
                             "(kt_oracle.needs_results; a KerasTuner without them makes the search wait, exactly)",
    ("oracle", "_get_size"): "keras-tuner: Hyperband's round sizes (the same reading)",
    ("tuner", "_get_checkpoint_fname"): "keras-tuner: which file a trial's best epoch is in (kt_trials: to the store)",
    ("tuner", "_get_build_config_fname"): "keras-tuner: which file a trial's build config is in (the same)",
    ("saver", "_save_model"): "keras-tuner: SaveBestEpoch's save, wrapped to upload each checkpoint (kt_trials)",
    # optuna (not Keras/TF), behind stratkit/tuning/optuna_study.py's version range (tested on 5.1.0; PRIVATE there)
    ("study", "_storage"): "optuna: the storage a study keeps its trials in, replaced by the search's "
                           "(optuna_study.distribute; Optuna has no public setter)",
    ("study", "_study_id"): "optuna: the study's id in that storage (the same)",
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: str  # "import", "module path", "private", "patch"
    name: str  # what it touches: a module path, an attribute name, or a patched target

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.name}"


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for a chain of names/attributes, `?` for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("super", "type"):
        return f"{node.func.id}()"
    return "?"


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_private(name: str) -> bool:
    return bool(_PRIVATE_NAME.match(name)) and not (name.startswith("__") and name.endswith("__"))


def _private_module(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _PRIVATE_MODULES)


class _Class:
    """A class defined in the scanned file: its own attribute names, and whether it extends Keras/TF."""

    def __init__(self, node: ast.ClassDef, external: set[str]) -> None:
        self.external_base = any(_root(base) in external for base in node.bases)
        self.own: set[str] = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.own.add(item.name)
            elif isinstance(item, ast.Assign):
                self.own.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                self.own.add(item.target.id)
        for item in ast.walk(node):  # self._x = ... anywhere in the class: an attribute of ours
            if isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and isinstance(item.value, ast.Name):
                self.own.add(item.attr)

    def owns(self, name: str) -> bool:
        return name in self.own or not self.external_base


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.findings: list[Finding] = []
        self.external: set[str] = set()  # names bound to keras/tensorflow/tf_keras modules or their members
        self.ours: set[str] = set()  # names imported from stratkit
        self.functions: set[str] = set()  # functions defined in this file (marking them is no patch)
        self.module_names: set[str] = set()  # module-level names of this file
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    top = alias.name.split(".")[0]
                    (self.external if top in _EXTERNAL_PACKAGES else self.ours if top == "stratkit" else set()).add(
                        bound)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top = node.module.split(".")[0]
                target = self.external if top in _EXTERNAL_PACKAGES else self.ours if top == "stratkit" else None
                if target is not None:
                    target.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.add(node.name)
        classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        for node in ast.walk(tree):  # `runner = SparkRunner(...)`, `process = cls.__new__(cls)`: objects of ours
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Call)
                    and _root(node.value.func) in self.ours | classes | {"self", "cls"}):
                self.ours.add(node.targets[0].id)
        for node in tree.body:
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(target, ast.Name):
                    self.module_names.add(target.id)
        self.selves: list[dict[str, _Class]] = [{}]
        self.classes: list[_Class] = []
        # For the gate's inventory: attribute stores and setattr calls on objects not of this file's
        # classes (root name, text), and private names classes define for Keras to read or override.
        self.stores: list[tuple[str | None, str]] = []
        self.class_privates: set[str] = set()

    def _add(self, node: ast.AST, kind: str, name: str) -> None:
        self.findings.append(Finding(self.path, node.lineno, kind, name))

    # -- scopes: which names are `self`/`cls` of a class of ours --------------------------------

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            self.visit(base)
        self.classes.append(_Class(node, self.external))
        self.class_privates.update(name for name in self.classes[-1].own if _is_private(name))
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(item, self.classes[-1])
            else:
                self.visit(item)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._function(node, None)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._scoped(node.args, None, [node.body])

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, cls: _Class | None) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        static = any(_dotted(d) == "staticmethod" for d in node.decorator_list)
        self._scoped(node.args, None if static else cls, node.body)

    def _scoped(self, args: ast.arguments, cls: _Class | None, body: list[ast.AST]) -> None:
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
        scope = {name: c for name, c in self.selves[-1].items() if name not in params}
        if cls is not None and params:
            scope[params[0]] = cls
        for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.visit(default)
        self.selves.append(scope)
        for statement in body:
            self.visit(statement)
        self.selves.pop()

    def _owner(self, node: ast.AST) -> _Class | None:
        if isinstance(node, ast.Name):
            return self.selves[-1].get(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("super", "type"):
            return self.classes[-1] if self.classes else None
        return None

    # -- the rules ----------------------------------------------------------------------------

    def _foreign_private(self, base: ast.AST, name: str) -> bool:
        """`base.name` is a private access to something that is not ours."""
        if not _is_private(name) or name.startswith(_OWN_PREFIX):
            return False
        owner = self._owner(base)
        if owner is not None:
            return not owner.owns(name)
        if isinstance(base, ast.Name) and base.id in self.ours:
            return False
        return (_dotted(base), name) not in ALLOWED

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _private_module(alias.name):
                self._add(node, "import", alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0:
            for alias in node.names:  # `from keras.src import tree` is keras.src.tree
                if _private_module(f"{module}.{alias.name}"):
                    self._add(node, "import", f"{module}.{alias.name}")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _MODULE_PATH.match(node.value):
            self._add(node, "module path", node.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._foreign_private(node.value, node.attr):
            self._add(node, "private", node.attr)
        self.visit(node.value)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        if (isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__" and isinstance(key, ast.Constant)
                and isinstance(key.value, str) and self._foreign_private(node.value.value, key.value)):
            self._add(node, "private", key.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = _dotted(node.func)
        if func in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and self._foreign_private(
                    node.args[0], name.value):
                self._add(node, "private", name.value)
            if func in ("setattr", "delattr") and _root(node.args[0]) in self.external:
                self._add(node, "patch", f"{func}({_dotted(node.args[0])}, ...)")
            if func == "setattr" and self._owner(node.args[0]) is None:
                self.stores.append((_root(node.args[0]), f"setattr({_dotted(node.args[0])}, {ast.unparse(name)})"))
        self.generic_visit(node)

    def _store(self, target: ast.AST) -> None:
        if isinstance(target, ast.Attribute) and self._owner(target.value) is None:
            self.stores.append((_root(target.value), _dotted(target)))
        if isinstance(target, ast.Attribute) and _root(target.value) in self.external:
            self._add(target, "patch", _dotted(target))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._store(element)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._store(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._store(node.target)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._store(target)
        self.generic_visit(node)


def scan(source: str, path: str = "<snippet>") -> list[Finding]:
    """The private Keras/TF uses and monkey-patches in one module's source."""
    tree = ast.parse(source)
    scanner = _Scanner(path, tree)
    scanner.visit(tree)
    return sorted(scanner.findings, key=lambda f: (f.line, f.kind, f.name))


def is_gate(relative: str) -> bool:
    """The version-gate modules: the keras_compat package and its `stratkit/strategy/keras_*.py` siblings."""
    return relative.startswith("stratkit/strategy/keras_compat/") or bool(
        re.fullmatch(r"stratkit/strategy/keras_\w+\.py", relative))


def modules(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in (root / "stratkit").rglob("*.py"))


def scan_tree(root: Path) -> dict[str, list[Finding]]:
    """Every stratkit module under `root` with its findings (modules without any are left out)."""
    found = {}
    for relative in modules(root):
        findings = scan((root / relative).read_text(encoding="utf-8"), relative)
        if findings:
            found[relative] = findings
    return found


def outside_gate(found: dict[str, list[Finding]], exceptions: frozenset[str] = frozenset()) -> list[str]:
    return [str(f) for path, findings in found.items() if not is_gate(path) and path not in exceptions
            for f in findings]


# -- the rule on stratkit itself ------------------------------------------------------------------


def test_no_private_keras_or_tensorflow_use_outside_the_gate():
    problems = outside_gate(scan_tree(REPO), TEMPORARY_EXCEPTIONS)
    assert not problems, (
        "private Keras/TF use outside the version gate (move it into stratkit/strategy/keras_compat/ or a "
        "stratkit/strategy/keras_*.py sibling, behind the gate; stdlib/pyspark/our own: add it to ALLOWED "
        "with the reason):\n  " + "\n  ".join(problems))


def test_the_temporary_exceptions_are_still_needed():
    found = scan_tree(REPO)
    stale = sorted(path for path in TEMPORARY_EXCEPTIONS if not found.get(path))
    assert not stale, f"{stale} no longer use private Keras/TF: remove them from TEMPORARY_EXCEPTIONS"


#: What the gate modules touch, per module: "import M" / "module path M" (a private module),
#: "private NAME" (an underscore attribute of a Keras/TF object, or such a name as a string the gate
#: looks up), "patch TARGET" (an assignment to a Keras/TF attribute, or a setattr on a Keras object).
#: A change here is a change in what stratkit depends on that no Keras release promises: the compat
#: suite (`make compat`) must prove it on every tested version.
GATE_INVENTORY: dict[str, set[str]] = {
    "stratkit/strategy/keras_ps.py": {
        "module path keras.src.backend.tensorflow.trainer", "module path keras.src.losses.loss",
        "module path tensorflow.python.distribute.sharded_variable",
        "private _call_has_training_arg", "private _compute_loss", "private _loss_tracker",
        "private _symbolic_build", "private _variant_tensor",
        "patch optimizer.built", "patch setattr(model, _STATE)", "patch sharded.__array__",
    },
    "stratkit/strategy/keras_compat/all_reduce.py": {
        "module path keras.src.backend.tensorflow.optimizer",
        "private _all_reduce_sum_gradients", "private _backend_update_step",
        "patch setattr(cls, _METHOD)",
    },
    "stratkit/strategy/keras_compat/batchnorm.py": {
        "module path keras.src.layers.normalization.batch_normalization",
        "patch cls._moments", "private _moments", "private _reduction_axes", "private _flatten_layers",
    },
    "stratkit/strategy/keras_compat/global_gradient.py": {
        "import keras.src.backend", "import keras.src.ops",
        "module path keras.src.backend.tensorflow.optimizer", "module path keras.src.losses.loss",
        "module path keras.src.optimizers.base_optimizer", "module path keras.src.optimizers.loss_scale_optimizer",
        "module path keras.src.trainers.compile_utils",  # CompileLoss.call: the per-output loss trackers
        "patch setattr(owner, name)",  # loss reduction, optimizer apply / update step / scale_loss (the one gradient path)
        "private _all_reduce_sum_gradients", "private _backend_apply_gradients", "private _backend_update_step",
        "private _distributed_tf_update_step", "private _distribution_strategy", "private _trainable_variables",
    },
    # gradient accumulation on N replicas (moved out of global_gradient.py, which calls it)
    "stratkit/strategy/keras_compat/accumulation.py": {
        "import keras.src.ops",
        "private _accumulated_gradients", "private _all_reduce_sum_gradients", "private _apply_weight_decay",
        "private _backend_increment_gradient_accumulators", "private _backend_reset_gradient_accumulators",
        "private _backend_update_step", "private _clip_gradients", "private _get_variable_index",
        "private _iterations", "private _overwrite_model_variables_with_average_value",
        "private _trainable_variables", "private _update_model_variables_moving_average",
    },
    # float8 on N replicas: the scales' and histories' maximum, the bias added with a float32 gradient
    "stratkit/strategy/keras_compat/float8.py": {
        "import keras.src.ops",
        "module path keras.src.layers.core.dense", "module path keras.src.layers.core.einsum_dense",
        "module path keras.src.optimizers.base_optimizer",
        "private _float8_call",  # Dense/EinsumDense: wrapped (installed by global_gradient.install)
        "private _overwrite_variables_directly_with",  # the self-check reads BaseOptimizer.apply's order
        "private _trainable_variables",
    },
    "stratkit/strategy/keras_compat/synced_logs.py": {
        "import keras.src.backend", "import keras.src.utils.python_utils", "module path keras.src.trainers.trainer",
        "patch cls._get_metrics_result_or_logs", "private _get_metrics_result_or_logs",
        "private _loss_tracker",  # its total gets the part of a replica without rows (Keras weighs it 0)
    },
    "stratkit/strategy/keras_compat/fit_guards.py": {
        "patch setattr(cls, name)",  # TensorFlowTrainer.fit / evaluate / predict / *_on_batch
        # another library's wrapper on keras.Model.fit (MLflow's autolog), guarded; and put back (revert)
        "patch setattr(keras.Model, name)", "patch setattr(keras.Model, ...)",
    },
    "stratkit/strategy/keras_compat/coordination.py": {
        # the coordination service's key-value store (insert / blocking get / delete): how a preemption notice
        # and the chief's timed backup reach every worker without a collective (TF's PreemptionCheckpointHandler's way)
        "import tensorflow.python.eager.context",
    },
    "stratkit/strategy/keras_compat/internals.py": {
        "import tensorflow.python.eager.context",
        "private _batch_size", "private _batch_sizes", "private _context_handle", "private _initial_epoch",
        "private _input_dataset", "private _learning_rate",
        "patch model._initial_epoch",
        # a custom loop's gradient accumulators: per replica by design, skipped by the replica check
        "private _accumulated_gradients",
    },
    "stratkit/strategy/keras_compat/metric_guard.py": {
        "import keras.src.backend.tensorflow.core", "import keras.src.metrics.metric",
        "private _direct_assign",
        "patch core.Variable._direct_assign", "patch metric.Metric.add_variable",
        "patch setattr(variable, _PS_METRIC_MARK)",
    },
    "stratkit/strategy/keras_compat/parameter_server.py": {
        "import keras.src.losses.loss.unscale_loss_for_distribution",
        "module path keras.src.losses.loss.unscale_loss_for_distribution",
        "private _call_has_training_arg", "private _compute_loss", "private _loss_tracker",
        "private _losses_override", "private _symbolic_build",
    },
    "stratkit/strategy/keras_compat/self_check.py": {
        "import tensorflow.python.distribute.values",
        "private _distribute_strategy", "private _extended", "private _in_multi_worker_mode",
        "private _maybe_symbolic_build", "private _symbolic_build",
    },
    "stratkit/strategy/keras_compat/array_shuffle.py": {
        # ArrayDataAdapter.get_tf_dataset wrapped: under a multi-worker fit with no global seed, its
        # tf.random.shuffle is swapped (for the building thread, while it builds) for an agreed stateless one
        "import keras.src.trainers.data_adapters.array_data_adapter",
        "import tensorflow.python.eager.context", "import tensorflow.python.framework.ops",
        "patch cls.get_tf_dataset", "patch tf.random.shuffle", "private _shuffle",
        # PyDatasetAdapter.__init__ wrapped: under a multi-worker fit, a shuffling adapter's module `random` is,
        # on the other workers, a Random holding the chief's state (put back when the fit ends)
        "import keras.src.trainers.data_adapters.py_dataset_adapter", "patch module.random", "patch py_cls.__init__",
    },
    "stratkit/strategy/keras_compat/dataset_graph.py": {
        # a tf.data pipeline's datasets (`_inputs()`) and a reader's file names, for sharding and Python's tensors
        "private _filenames", "private _inputs",
    },
    "stratkit/strategy/keras_compat/distributed_input.py": {
        # the strategy object's own experimental_distribute_dataset wrapped (as factory.host_inputs does)
        "patch strategy.experimental_distribute_dataset",
    },
    "stratkit/strategy/keras_compat/sharding.py": {
        "patch options.experimental_distribute.auto_shard_policy",  # a fresh tf.data.Options: public API
    },
    "stratkit/strategy/keras_compat/layer_losses.py": {
        # Layer.add_loss / _get_own_losses / _clear_losses wrapped: a list per replica thread under Mirrored/MWMS
        "import keras.src.backend", "import keras.src.layers.layer",
        "patch setattr(cls, name)", "private _clear_losses", "private _get_own_losses", "private _layers",
        "private _losses",
    },
    "stratkit/strategy/keras_compat/on_batch.py": {
        # the model's train/test/predict function swapped, while one *_on_batch call runs, for one fed shares
        "patch setattr(model, attribute)",
    },
    "stratkit/strategy/keras_compat/optimizer_build.py": {
        # an unbuilt optimizer's first apply in a replica context (several devices): built in a merge_call
        "import keras.src.backend", "patch optimizer.built",
    },
    "stratkit/strategy/keras_compat/replica_seeds.py": {
        # keras.random.SeedGenerator.next wrapped: the seed it hands out folded with the replica id (N > 1 replicas)
        "patch cls.next",
    },
    "stratkit/strategy/keras_compat/replica_state.py": {
        # the TF backend Variable's _direct_assign wrapped: a layer's state assigned in a replica step gets the
        # replicas' row-weighted mean; the self-check reads the common Variable.assign that calls it
        "module path keras.src.backend.common.variables", "module path keras.src.backend.tensorflow.core",
        "module path keras.src.layers.normalization.batch_normalization",
        "patch cls._direct_assign", "private _direct_assign", "private _flatten_layers",
        "private _non_trainable_variables",
    },
    "stratkit/strategy/keras_compat/save_guards.py": {
        # keras.Model.save / save_weights / export wrapped, and put back; what Keras prints while it writes held
        # until the path holds it (io_utils.print_msg, for the writing thread, while it writes)
        "patch delattr(keras.Model, ...)", "patch setattr(keras.Model, ...)", "patch setattr(keras.Model, name)",
        "import keras.src.utils.io_utils", "patch io_utils.print_msg",
    },
    "stratkit/strategy/keras_compat/variable_scalars.py": {
        "import keras.src.backend.tensorflow.core",
        "patch setattr(cls, name)",  # Variable.__float__ / __int__ for distributed values
    },
    "stratkit/strategy/keras_compat/resume_step.py": {
        # EpochIterator._enumerate_iterator wrapped: a resumed fit's first epoch starts at the backup's step
        # (its first tuples dropped); the iterator's kind (an endless stream or finite passes) read for the replay
        "import keras.src.trainers.epoch_iterator", "patch cls._enumerate_iterator", "private _enumerate_iterator",
        "private _num_batches",
    },
    "stratkit/strategy/keras_compat/callback_state.py": {
        # the counters of Keras's EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, TensorBoard and History,
        # read and written back for a backup
        "patch callback.best_weights", "patch callback.epoch", "patch callback.history",
        "patch setattr(callback, name)", "private _batches_seen_since_last_saving", "private _current_epoch",
        "private _global_train_batch", "private _last_batch_seen",
    },
    # TensorFlowTrainer._make_function: the step's call waits for its batch (a step whose get_next fails runs nothing)
    "stratkit/strategy/keras_compat/step_gate.py": {
        "module path keras.src.backend.tensorflow.trainer", "private _make_function", "patch cls._make_function",
        "private _add_control_input",  # on the step's call op (tf.control_dependencies drops it there)
        "patch cell.cell_contents",  # the call Keras's step closures share (one_step_on_data), gated
    },
    "stratkit/strategy/keras_compat/trainer_patches.py": {
        "import keras.src.tree",
        "module path keras.src.backend.tensorflow.trainer",
        "private _distribute_strategy", "private _in_multi_worker_mode", "private _maybe_symbolic_build",
        "private _symbolic_build",
        "private _distributed_dataset", "private _value_specs",  # the build reads the input's element spec
        "patch cls._maybe_symbolic_build", "patch m.TensorFlowTrainer._maybe_symbolic_build",
        "patch m.reduce_per_replica",
    },
}


def inventory(source: str, path: str) -> set[str]:
    """What one gate module touches (see GATE_INVENTORY): the findings, plus what only a gate may do.

    Beyond the rule's findings it lists private names the module holds as strings (looked up with
    getattr/hasattr or `__dict__`) or defines in a class (a stand-in or subclass Keras reads), and
    attribute stores / `setattr` on objects the module got at run time (a local or a parameter, not
    `self` of its own class, not a function of its own, not a module-level name).
    """
    tree = ast.parse(source)
    scanner = _Scanner(path, tree)
    scanner.visit(tree)
    names = {f"{f.kind} {f.name}" for f in scanner.findings}
    names.update(f"private {name}" for name in scanner.class_privates if not name.startswith(_OWN_PREFIX))
    names.update(f"private {node.value}" for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and _is_private(node.value) and not node.value.startswith(_OWN_PREFIX))
    names.update(f"patch {target}" for root, target in scanner.stores
                 if root and root not in scanner.module_names | scanner.functions | scanner.ours)
    return names


def test_the_inventory_of_private_names_the_gate_touches():
    gates = [p for p in modules(REPO) if is_gate(p)]
    actual = {p: inventory((REPO / p).read_text(encoding="utf-8"), p) for p in gates}
    actual = {p: names for p, names in actual.items() if names}
    if actual != GATE_INVENTORY:
        lines = []
        for path in sorted(set(actual) | set(GATE_INVENTORY)):
            now, listed = actual.get(path, set()), GATE_INVENTORY.get(path, set())
            if now - listed:
                lines.append(f"{path}: new {sorted(now - listed)}")
            if listed - now:
                lines.append(f"{path}: no longer {sorted(listed - now)}")
        pytest.fail("the gate's private Keras/TF uses changed; prove them with `make compat` and update "
                    "GATE_INVENTORY:\n  " + "\n  ".join(lines))


# -- the scanner itself can fail ------------------------------------------------------------------

_SNIPPET = '''\
import os
import keras
from keras.src import tree
from tensorflow.python.eager import context
from stratkit.spark import layout


def resume(model, optimizer):
    model._initial_epoch = 3
    rate = getattr(optimizer, "_learning_rate")
    keras.Model.fit = lambda *a: None
    module = "keras.src.backend.tensorflow.trainer"
    layout._positive_int("x", 1)
    os._exit(0)
    return type(model).__dict__["_maybe_symbolic_build"], model.__class__, rate, module


class Watcher(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self._seen = epoch
        return self._seen, self._model, super()._implements_train_batch_hooks()

    def helper(self):
        def inner(self):
            return self._reads_through_a_parameter
        return inner


class Plain:
    def __init__(self):
        self._anything = 1

    def read(self, other):
        return self._anything, self._inherited_from_object_or_ours, other._foreign
'''


def test_the_scanner_flags_each_kind_of_private_use_at_its_line():
    found = [str(f) for f in scan(_SNIPPET, "stratkit/training/bad.py")]
    assert found == [
        "stratkit/training/bad.py:3: import keras.src.tree",
        "stratkit/training/bad.py:4: import tensorflow.python.eager.context",
        "stratkit/training/bad.py:9: private _initial_epoch",
        "stratkit/training/bad.py:10: private _learning_rate",
        "stratkit/training/bad.py:11: patch keras.Model.fit",
        "stratkit/training/bad.py:12: module path keras.src.backend.tensorflow.trainer",
        "stratkit/training/bad.py:15: private _maybe_symbolic_build",
        "stratkit/training/bad.py:21: private _implements_train_batch_hooks",  # super() of a Keras class
        "stratkit/training/bad.py:21: private _model",  # inherited from keras.callbacks.Callback
        "stratkit/training/bad.py:25: private _reads_through_a_parameter",  # `self` of a nested function
        "stratkit/training/bad.py:34: private _foreign",
    ]


def test_a_private_use_outside_the_gate_fails_naming_the_file_and_line(tmp_path):
    for relative, source in {
        "stratkit/training/bad.py": "def f(model):\n    return model._initial_epoch\n",
        "stratkit/strategy/keras_compat/internals.py": "def f(model):\n    return model._initial_epoch\n",
        "stratkit/strategy/keras_ps.py": "from keras.src import tree\n",
        "stratkit/strategy/not_a_gate.py": "from keras.src import tree\n",
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source)
    assert outside_gate(scan_tree(tmp_path)) == [
        "stratkit/strategy/not_a_gate.py:1: import keras.src.tree",
        "stratkit/training/bad.py:2: private _initial_epoch",
    ]
