"""The executor-equivalence module's harness (its configs, batches and single-process reference) for
other test modules: loaded from its file under a name of its own, so pytest does not collect its tests
twice."""
import importlib.util
import pathlib
from types import ModuleType


def load_equivalence_harness() -> ModuleType:
    path = pathlib.Path(__file__).with_name("test_executor_equivalence.py")
    spec = importlib.util.spec_from_file_location("hgraph_tests_equivalence_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
