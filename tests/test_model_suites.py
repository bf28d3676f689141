"""Every architecture of the registry runs a shared model suite: some tests/test_models_*.py module
lists its model_type in `COVERS`, and each such module runs every check of the suite it draws on
(tests/family_suite.py for text families, tests/vl_suite.py for vision-language ones) unless its
`OPT_OUTS` names the check with the reason it does not apply."""

import importlib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from tests import family_suite, vl_suite

from kestrel.models.registry import ARCHITECTURES

SUITES = {"tests/family_suite.py": family_suite, "tests/vl_suite.py": vl_suite}
FAMILY_FILES = sorted(p.stem for p in Path(__file__).parent.glob("test_models_*.py"))


def family_modules() -> list[ModuleType]:
    return [importlib.import_module(f"tests.{name}") for name in FAMILY_FILES]


def uncovered(architectures, modules) -> list[str]:
    """The registry keys no module lists in `COVERS`."""
    covered = {t for m in modules for t in getattr(m, "COVERS", ())}
    return sorted(set(architectures) - covered)


def suite_problems(module) -> list[str]:
    """What keeps `module` from running its whole suite: a shared check neither imported nor
    opted out, an opt-out without a reason, or one that names no check or a check it runs."""
    opt_outs = getattr(module, "OPT_OUTS", None)
    if not isinstance(opt_outs, dict):
        return ["no OPT_OUTS dict (an empty one when every shared check applies)"]
    drawn = [
        path
        for path, suite in SUITES.items()
        if any(getattr(module, check.__name__, None) is check for check in suite.CHECKS)
    ]
    if not drawn:
        return [f"runs no check of {' or '.join(SUITES)}"]
    checks = {check.__name__: check for path in drawn for check in SUITES[path].CHECKS}
    problems = []
    for name, check in checks.items():
        runs = getattr(module, name, None) is check
        if not runs and name not in opt_outs:
            problems.append(f"{name} neither runs nor is in OPT_OUTS")
        if runs and name in opt_outs:
            problems.append(f"{name} runs but is in OPT_OUTS")
    for name, reason in opt_outs.items():
        if name not in checks:
            problems.append(f"OPT_OUTS names {name!r}, no check of {' or '.join(drawn)}")
        if not isinstance(reason, str) or not reason.strip():
            problems.append(f"OPT_OUTS gives no reason for {name}")
    return problems


def test_every_registered_architecture_has_a_suite():
    missing = uncovered(ARCHITECTURES, family_modules())
    assert not missing, (
        f"no model suite covers {', '.join(missing)}: add its model_type to the COVERS of a "
        "tests/test_models_<family>.py that runs tests/family_suite.py (or tests/vl_suite.py)"
    )


def test_covers_lists_only_registered_architectures():
    for module in family_modules():
        assert set(getattr(module, "COVERS", ())) <= set(ARCHITECTURES), module.__name__


@pytest.mark.parametrize("name", FAMILY_FILES)
def test_family_module_runs_its_whole_suite(name):
    module = importlib.import_module(f"tests.{name}")
    assert getattr(module, "COVERS", ()), f"{name} declares no COVERS"
    problems = suite_problems(module)
    assert not problems, f"{name}: " + "; ".join(problems)


# --- the checks themselves fail when they should ------------------------------------------------


def test_an_architecture_without_a_suite_is_named():
    modules = [SimpleNamespace(COVERS=("llama",))]
    assert uncovered({"llama": "", "new_family": ""}, modules) == ["new_family"]


def test_a_check_missing_without_an_opt_out_is_named():
    ran = {c.__name__: c for c in family_suite.CHECKS[1:]}  # all but the first
    module = SimpleNamespace(COVERS=("llama",), OPT_OUTS={}, **ran)
    first = family_suite.CHECKS[0].__name__
    assert suite_problems(module) == [f"{first} neither runs nor is in OPT_OUTS"]
    module.OPT_OUTS = {first: ""}
    assert suite_problems(module) == [f"OPT_OUTS gives no reason for {first}"]
    module.OPT_OUTS = {first: "does not apply"}
    assert suite_problems(module) == []
