"""TEST-ONLY fault injection, enabled by an environment variable read once at startup.

    KESTREL_TEST_FAULTS="forward:MARK1,sample:MARK2,detokenize:MARK3,loop:MARK4"

makes a request whose prompt text contains MARKn raise at that stage: "forward", "sample" (the
runner, isolated to the request), "detokenize" (the engine, isolated) or "loop" (the engine loop
itself, which kills it: the engine-death path). Without the variable no hook is installed, so
nothing in a request can reach this code.
"""

import os

from kestrel.engine.engine import Engine

ENV_VAR = "KESTREL_TEST_FAULTS"
STAGES = ("forward", "sample", "detokenize", "loop")


class InjectedFault(RuntimeError):
    """The error a test-only fault raises."""


def parse(spec: str) -> dict[str, str]:
    """ "stage:marker,..." -> {stage: marker}; raises ValueError on a malformed spec."""
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        stage, _, marker = item.partition(":")
        if stage not in STAGES or not marker:
            raise ValueError(f"{ENV_VAR}: bad item {item!r}; use stage:marker, stage in {STAGES}")
        faults[stage] = marker
    return faults


class FaultHook:
    def __init__(self, faults: dict[str, str], tokenizer):
        self.faults = faults
        self.tokenizer = tokenizer
        self.prompts: dict[str, str] = {}  # request id -> prompt text, decoded once

    def __call__(self, stage: str, request) -> None:
        marker = self.faults.get(stage)
        if marker is not None and marker in self._prompt(request):
            raise InjectedFault(f"test fault at {stage} for request {request.request_id}")

    def _prompt(self, request) -> str:
        if request.request_id not in self.prompts:
            if len(self.prompts) > 4096:
                self.prompts.clear()
            self.prompts[request.request_id] = self.tokenizer.decode(request.prompt_ids)
        return self.prompts[request.request_id]


def install_from_env(engine: Engine, environ=os.environ) -> bool:
    """Install the hook on the runner and the engine when the variable is set."""
    spec = environ.get(ENV_VAR)
    if not spec:
        return False
    hook = FaultHook(parse(spec), engine.tokenizer)
    engine.runner.fault_hook = hook
    engine.fault_hook = hook
    return True
