"""The documentation stays true to the code: the site builds strictly, and each generated or quoted part matches.

* `mkdocs build --strict` passes (broken links and anchors are warnings, so errors);
* the environment page lists exactly the variables and Spark confs the code reads;
* every troubleshooting message still occurs in the code;
* every public name is in the API reference, and the CLI reference is `--help`;
* every Python block in README.md and docs/ runs in the suite or says why not;
* README.md is a front page: short, and it links every docs page.

Fast (about 5 s, most of it the build) and TensorFlow-free: the code is read with `ast`.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PACKAGE = REPO / "stratkit"
sys.path.insert(0, str(REPO / "tools"))

import docs_hooks  # noqa: E402 - tools/ is not a package

ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]{3,}$")
STRATKIT_VAR = re.compile(r"\bSTRATKIT_[A-Z0-9_]*[A-Z0-9]\b")
SPARK_CONF = re.compile(r"\b(?:spark\.stratkit|tensorflow\.spark\.distributor)\.[A-Za-z]+\b")


def _modules(root: Path = PACKAGE) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(root.rglob("*.py"))]


def _string_constants(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


# -- what the code reads ---------------------------------------------------------------------------


def _is_environ(node: ast.AST) -> bool:
    """`os.environ`, `environ`, `env`, `base_env`, `self.environ`: a mapping of environment variables."""
    return ast.unparse(node).split(".")[-1].endswith(("environ", "env", "environment"))


def _literal_strings(node: ast.AST | None) -> tuple[str, ...]:
    """The strings of a literal: a constant, or nested tuples/lists/dicts of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return tuple(s for e in node.elts for s in _literal_strings(e))
    if isinstance(node, ast.Dict):
        return tuple(s for part in (*node.keys, *node.values) for s in _literal_strings(part))
    return ()


def env_vars_read(modules: list[tuple[Path, ast.Module]]) -> set[str]:
    """Variables read with `environ.get(X)`, `environ[X]`, `X in environ` or `os.getenv(X)`, and every STRATKIT_*.

    X is a string, a module constant (`ENV_VAR = "STRATKIT_..."`, a tuple of names) or a loop variable
    over such a tuple (`for var in _TPU_VARS: environ.get(var)`). Every STRATKIT_* name in a string of the
    package counts as read: the launcher reads its flags' variables through a table.
    """
    names: set[str] = set()
    for _, tree in modules:
        consts = {n.targets[0].id: _literal_strings(n.value) for n in tree.body
                  if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
        scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
        for scope in scopes:
            loops: dict[str, tuple[str, ...]] = {}
            for node in ast.walk(scope):
                if isinstance(node, (ast.comprehension, ast.For)):
                    target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
                    source = node.iter.value if isinstance(node.iter, ast.Subscript) else node.iter
                    if isinstance(target, ast.Name):
                        loops[target.id] = (consts.get(source.id, ()) if isinstance(source, ast.Name)
                                            else _literal_strings(source))
            for node in ast.walk(scope):
                key = None
                func = node.func if isinstance(node, ast.Call) else None
                if func is not None and node.args and (
                        (isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value))
                        or ast.unparse(func) == "os.getenv"):
                    key = node.args[0]
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
                    key = node.slice
                elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In)
                      and _is_environ(node.comparators[0])):
                    key = node.left
                if key is None:
                    continue
                found = (loops.get(key.id) or consts.get(key.id, ())) if isinstance(key, ast.Name) \
                    else _literal_strings(key)
                names.update(v for v in found if ENV_NAME.match(v))
        for text in _string_constants(tree):
            names.update(STRATKIT_VAR.findall(text))
    return names


def spark_confs_read(modules: list[tuple[Path, ast.Module]]) -> set[str]:
    return {conf for _, tree in modules for text in _string_constants(tree) for conf in SPARK_CONF.findall(text)}


def _table_names(page: str) -> set[str]:
    """Every backticked name in the first cell of a table row (`| `A`, `B` | ...`)."""
    names = set()
    for line in page.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


ENVIRONMENT_PAGE = DOCS / "reference" / "environment.md"


def test_the_environment_page_lists_exactly_the_variables_the_code_reads():
    read = env_vars_read(_modules())
    listed = {n for n in _table_names(ENVIRONMENT_PAGE.read_text()) if ENV_NAME.match(n)}
    assert not read - listed, f"read by stratkit but not in {ENVIRONMENT_PAGE.name}: {sorted(read - listed)}"
    assert not listed - read, f"in {ENVIRONMENT_PAGE.name} but not read by stratkit: {sorted(listed - read)}"


def test_the_environment_page_lists_exactly_the_spark_confs_the_code_reads():
    read = spark_confs_read(_modules())
    listed = {n for n in _table_names(ENVIRONMENT_PAGE.read_text()) if SPARK_CONF.fullmatch(n)}
    assert read and read == listed, \
        f"only in the code: {sorted(read - listed)}; only on the page: {sorted(listed - read)}"


def test_the_variable_scan_sees_every_way_the_code_reads_one():
    code = ('import os\nTOKEN_VAR = "A_TOKEN"\nHOSTS = ("H_ONE", "H_TWO")\n'
            'def f(environ, env):\n'
            '    os.environ.get("A_GET"); environ["A_ITEM"]; "A_IN" in env; os.getenv("A_GETENV")\n'
            '    env.get(TOKEN_VAR); [v for v in HOSTS if environ.get(v)]\n'
            '    env["NOT_READ"] = "1"; print("STRATKIT_NAMED")\n')
    names = env_vars_read([(Path("x.py"), ast.parse(code))])
    assert names == {"A_GET", "A_ITEM", "A_IN", "A_GETENV", "A_TOKEN", "H_ONE", "H_TWO", "STRATKIT_NAMED"}


# -- troubleshooting ------------------------------------------------------------------------------

TROUBLESHOOTING = DOCS / "troubleshooting.md"
_MESSAGE = re.compile(r"<!-- message from: (\w+) -->\n```text\n(.*?)\n```", re.S)


def _rendered_strings() -> list[str]:
    """Every string the package builds, f-strings with each `{value}` as \\0 (a module's own string
    constants filled in: `{TOKEN_VAR}` reads as the user sees it)."""
    def constants(tree: ast.Module) -> dict[str, str]:
        return {n.targets[0].id: n.value.value for n in tree.body
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}

    modules = _modules()
    every: dict[str, str] = {}  # a constant imported from another module (`from ... import TOKEN_VAR`)
    for _, tree in modules:
        every.update(constants(tree))
    out = []
    for _, tree in modules:
        consts = {**every, **constants(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = []
                for value in node.values:
                    if isinstance(value, ast.Constant):
                        parts.append(value.value)
                    elif isinstance(value.value, ast.Name) and value.value.id in consts and not value.format_spec:
                        parts.append(consts[value.value.id])
                    else:
                        parts.append("\0")
                out.append("".join(parts))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def _occurs(message: str, strings: list[str]) -> bool:
    """The message's literal parts (around `<...>` placeholders) occur in order in one string."""
    pieces = [p for p in re.split(r"<[^<>]*>", message) if p.strip()]
    for text in strings:
        at = 0
        for piece in pieces:
            at = text.find(piece, at)
            if at < 0:
                break
            at += len(piece)
        else:
            return True
    return False


def _package_text(name: str) -> str | None:
    try:
        module = __import__(name)
    except ImportError:
        return None
    root = Path(module.__file__).parent
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.suffix in (".py", ".json"))


def test_every_troubleshooting_message_still_occurs_in_the_code():
    """stratkit's own messages are searched in its strings; pyspark's in pyspark; the others (TensorFlow,
    h5py, Spark's JVM, the OS, Python) in the stratkit code that detects or names them."""
    messages = _MESSAGE.findall(TROUBLESHOOTING.read_text())
    assert len(messages) >= 30
    strings = _rendered_strings()
    source = "\n".join(p.read_text() for p, _ in _modules())
    missing = []
    for origin, message in messages:
        if origin == "stratkit":
            found = _occurs(message, strings)
        elif origin == "pyspark":
            text = _package_text("pyspark")
            if text is None:
                continue
            found = message in text
        else:
            found = message in source
        if not found:
            missing.append(f"[{origin}] {message}")
    assert not missing, "troubleshooting quotes messages the code no longer has:\n" + "\n".join(missing)


def test_the_troubleshooting_page_covers_the_messages_users_meet():
    page = TROUBLESHOOTING.read_text()
    for anchor in ("collective-ops-must-be-configured-at-program-startup", "temporary-failure-in-name-resolution",
                   "barrier-stage-requires-more-slots", "no-module-named-stratkit", "keras-version-refused",
                   "fp16-gradients-overflowed", "rendezvous-token-refused"):
        assert f"#{anchor}" in page
    for message in ("unable to lock file", "often out of memory",
                    "Java gateway process exited"):
        assert message in page
    assert page.count("<!-- message from: stratkit -->") >= 20


# -- reference ---------------------------------------------------------------------------------


def _public_names(module: str) -> list[str]:
    path = REPO / (module.replace(".", "/") + "/__init__.py")
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    raise AssertionError(f"{module} has no __all__")


@pytest.mark.parametrize("module", ["stratkit", "stratkit.callbacks", "stratkit.launch", "stratkit.spark",
                                    "stratkit.ray", "stratkit.storage"])
def test_every_public_name_is_in_the_api_reference(module):
    page = (DOCS / "reference" / "api.md").read_text()
    if module == "stratkit.callbacks":
        path = PACKAGE / "callbacks.py"
        names = next(ast.literal_eval(n.value) for n in ast.parse(path.read_text()).body
                     if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "__all__")
    else:
        names = _public_names(module)
    missing = [f"{module}.{name}" for name in names
               if f"::: {module}.{name}\n" not in page and f'heading: "{module}.{name}"' not in page]
    assert not missing, f"not in docs/reference/api.md: {missing}"


@pytest.mark.parametrize("command", docs_hooks.CLI_COMMANDS, ids=lambda c: " ".join(("stratkit", *c)))
def test_the_cli_reference_is_what_help_prints(command):
    env = {**os.environ, "COLUMNS": docs_hooks.HELP_COLUMNS, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "stratkit.cli", *command, "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert docs_hooks.cli_help(command) == proc.stdout
    assert "<!-- generated: cli -->" in (DOCS / "reference" / "cli.md").read_text()


def test_the_supported_versions_table_is_on_its_page():
    assert "<!-- compat-table:begin" in (DOCS / "reference" / "versions.md").read_text()


# -- samples ---------------------------------------------------------------------------------------

#: Files the pages include or copy, and the test that runs each.
RUN_SAMPLES = {
    "examples/quickstart.py": "tests/examples/test_examples.py",
    "examples/spark_train.py": "tests/examples/test_examples.py",
    "examples/callback_state.py": "tests/examples/test_examples.py",
    "examples/check_exact.py": "tests/examples/test_examples.py",
    "examples/train_from_lake.py": "tests/examples/test_examples.py",
    "examples/tune_keras_tuner.py": "tests/examples/test_examples.py",
    "spark_jobs/pipeline_job.py": "tests/spark/test_pipeline_job.py",
    "examples/mlflow_train.py": "tests/training/tracking_train.py",
    "examples/tune_optuna.py": "tests/examples/test_examples.py",
    "examples/tune_spark.py": "tests/spark/test_spark_tune.py",
}
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_python_block_runs_in_the_suite_or_says_why_not():
    problems = []
    for page in _pages():
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            body = match.group(1)
            before = text[:match.start()].rstrip("\n").splitlines()[-1:] or [""]
            reason = re.fullmatch(r"<!-- not run: (.{10,}) -->", before[0])
            include = re.fullmatch(r'--8<-- "([^"]+)"\n', body)
            copied = next((f for f in RUN_SAMPLES if (REPO / f).read_text().strip() == body.strip()), None)
            where = f"{page.relative_to(REPO)}:{text[:match.start()].count(chr(10)) + 1}"
            if include:
                if include.group(1).split(":")[0] not in RUN_SAMPLES:  # "file:first:last" includes lines
                    problems.append(f"{where}: includes {include.group(1)}, which no test runs (RUN_SAMPLES)")
            elif not reason and not copied:
                problems.append(f"{where}: a Python block that no test runs and no '<!-- not run: why -->' explains")
    for sample, test in RUN_SAMPLES.items():
        assert Path(sample).name in (REPO / test).read_text(), f"{test} does not run {sample}"
    assert not problems, "\n".join(problems)


def test_the_readme_quickstart_is_the_example_the_tests_run():
    assert (REPO / "examples" / "quickstart.py").read_text().strip() in (REPO / "README.md").read_text()


# -- the front page and the build ------------------------------------------------------------


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", readme))
    pages = {str(p.relative_to(REPO)) for p in DOCS.rglob("*.md")}
    assert pages <= linked, f"README does not link: {sorted(pages - linked)}"
    assert "make demo" in readme and "make test" in readme
    assert not re.search(r"\d+ tests\b|\d+ minutes\b", readme), "no test counts or timings on the front page"


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="pip install -e '.[docs]' (make install does)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert 'id="stratkit.Trainer.fit"' in api and 'id="stratkit.spark.SparkRunner"' in api
    assert "usage: stratkit launch" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
