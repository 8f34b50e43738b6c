"""The Python API as an editor and `help()` see it: the real functions with their own signatures, every
parameter documented, the result types exported, and `import gpudl` still light."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

import gpudl


@pytest.mark.parametrize("name,module", [("fit", "gpudl.run.fit"), ("train", "gpudl.run.recipe"),
                                         ("plan", "gpudl.run.plan")])
def test_the_entry_points_are_the_real_functions_with_every_parameter_documented(name, module):
    function = getattr(gpudl, name)
    assert function is getattr(sys.modules[module], name)
    params = [p for p in inspect.signature(function).parameters if p != "probe_on_cpu"]  # internal, for tests
    assert "options" not in params and len(params) >= 3
    doc = inspect.getdoc(function)
    if name == "train":  # three parameters, said in its prose
        assert all(f"`{p}`" in doc or p in ("cfg", "console") for p in params), doc
        return
    args = doc.split("Args:")[1].split("Returns:")[0]
    documented = re.findall(r"^    (\w+):", args, flags=re.M)
    assert documented == params, f"{name}'s Args section lists {documented}, its signature {params}"


def test_fit_has_every_keyword_it_had():
    """The 27 parameters fit takes (adding one is fine: add it here and to the docstring)."""
    assert list(inspect.signature(gpudl.fit).parameters) == [
        "model", "train_data", "loss", "val_data", "metrics", "max_steps", "batch_size", "lr", "weight_decay",
        "warmup_steps", "grad_accum", "grad_clip", "device", "precision", "compile", "activation_checkpointing",
        "log_every", "eval_every", "checkpoint_every", "seed", "run_dir", "resume", "progress", "quiet", "parallel",
        "memory_limit", "plan"]


def test_the_result_types_are_exported_and_documented():
    from gpudl import FitResult, Metrics, ParallelConfig, Plan, RunResult  # a from-import finds them too

    for cls in (FitResult, Metrics, ParallelConfig, Plan, RunResult):
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), cls  # its own words, not dataclass's
    assert set(gpudl.__all__) <= set(dir(gpudl))
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        gpudl.fitt


def test_import_gpudl_imports_no_entry_point():
    code = ("import sys, gpudl; heavy = [m for m in sys.modules if m.startswith(('gpudl.run', 'gpudl.memory', "
            "'gpudl.training', 'gpudl.serve', 'gpudl.distributed'))]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
