"""What stratkit reads from the structure of a `tf.data` pipeline: its datasets, their functions' ops, its files.

tf.data has no public way to walk a pipeline: each dataset object keeps the
ones it reads in the private ``_inputs()`` (and a reader its file names in
``_filenames``); a transformation's function is a ``StructuredFunctionWrapper``
attribute whose traced graph lists its ops. Serializing the whole pipeline
(``DatasetToGraphV2``) would also say it, but embeds every constant, so an
in-memory dataset of a gigabyte would be copied to be looked at. Only the
Python objects and the functions' graphs are read here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: The file readers TensorFlow's auto-sharding looks for (its FILE policy splits the file names they read).
READER_OPS = frozenset({"TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset", "FixedLengthRecordDataset",
                        "FixedLengthRecordDatasetV2", "ArrayRecordDataset", "RecordIODataset", "SSTableDataset"})
#: Ops that hand tensors from Python to TensorFlow (`from_generator`, `tf.py_function`, `tf.numpy_function`).
PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
#: Pipelines are short; never loop on a strange graph.
_MAX_NODES = 256


def inputs_of(dataset: Any) -> list[Any]:
    """The datasets `dataset` reads (none for a source)."""
    try:
        return list(dataset._inputs())
    except Exception:  # noqa: BLE001 - not a dataset tf.data knows: nothing upstream to read
        return []


def datasets(dataset: Any) -> Iterator[Any]:
    """`dataset` and every dataset upstream of it (each once)."""
    seen: set[int] = set()
    stack = [dataset]
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(inputs_of(node))


def function_ops(dataset: Any) -> set[str]:
    """The op types in the functions of one dataset (`map`'s, `interleave`'s, `from_generator`'s), nested ones too."""
    ops: set[str] = set()
    for value in vars(dataset).values():
        graph = getattr(getattr(value, "function", None), "graph", None)
        if graph is None or not hasattr(graph, "as_graph_def"):
            continue
        graph_def = graph.as_graph_def()
        ops.update(node.op for node in graph_def.node)
        ops.update(node.op for function in graph_def.library.function for node in function.node_def)
    return ops


def reads_python(dataset: Any) -> bool:
    """Whether any dataset of the pipeline gets tensors from Python (a generator, `py_function`, `numpy_function`)."""
    return any(function_ops(node) & PYTHON_OPS for node in datasets(dataset))


def file_names(dataset: Any) -> Any | None:
    """The dataset of file names FILE sharding would split, or None when no file reader is found.

    As TensorFlow's auto-sharding does, from `dataset` upstream to the first
    reader: a reader made from a list of files (``TFRecordDataset(files)``)
    holds them in ``_filenames``; a reader made in a function
    (``list_files(...).interleave(TFRecordDataset)``) reads the names its
    transformation's input yields. A transformation of several inputs (``zip``,
    ``concatenate``, sampling) ends the search: None.
    """
    import tensorflow as tf

    node = dataset
    for _ in range(_MAX_NODES):
        names = getattr(node, "_filenames", None)
        if isinstance(names, tf.data.Dataset):
            return names
        upstream = inputs_of(node)
        if function_ops(node) & READER_OPS:
            return upstream[0] if len(upstream) == 1 else None
        if len(upstream) != 1:
            return None
        node = upstream[0]
    return None
