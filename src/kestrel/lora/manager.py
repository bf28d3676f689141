"""The engine's adapters: which are loaded, which slot each holds, each step's token slots.

An adapter is read and checked when it is loaded (`load`), kept on the host, and copied into a
device slot when a request that names it first runs. Slots are few (--max-loras): a new
adapter takes a free one or the least recently used one that no running request holds; the
scheduler never runs more distinct adapters at once than there are slots. Unloading forgets
the name at once; requests already running with it finish with it (its slot stays theirs).
Each loaded adapter has its own prefix-cache key, so blocks computed under one adapter (or the
base model) are never reused by another, nor by a later adapter loaded under the same name.
"""

import hashlib
import itertools
from collections import OrderedDict

import torch

from kestrel.errors import InvalidRequestError
from kestrel.lora.adapter import LoRAAdapter, read_adapter
from kestrel.models.layers.lora import TokenSlots, attach


class LoRAManager:
    def __init__(self, model, max_loras: int, max_rank: int, max_tokens: int, device, dtype):
        if max_loras < 1 or max_rank < 1:
            raise InvalidRequestError("--max-loras and --max-lora-rank must be >= 1", "max_loras")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.tokens = TokenSlots(max_tokens, device)
        # the decoder's projections: not a vision tower's (other rows), nor an MTP layer's
        skip = tuple(f"{prefix}." for prefix in (*getattr(model, "replicated", ()), "mtp"))
        modules = [(n, m) for n, m in model.named_modules() if not f"{n}.".startswith(skip)]
        self.sites = attach(modules, self.tokens, max_loras + 1, max_rank, dtype)
        self.shapes = {n: (site.a.shape[-1], site.parts[p]) for n, (site, p) in self.sites.items()}
        self.names: dict[str, bytes] = {}  # loaded name -> its key
        self.adapters: dict[bytes, LoRAAdapter] = {}  # key -> adapter (also unloaded, in use)
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free = list(range(max_loras, 0, -1))
        self.bound: dict[str, bytes] = {}  # request id -> the key it runs with
        self._ids = itertools.count(1)

    # -- loading ----------------------------------------------------------------------------

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the adapter at `path` under `name`; InvalidRequestError names the
        problem and changes nothing."""
        if not name or not isinstance(name, str):
            raise InvalidRequestError("lora_name must be a non-empty string", "lora_name")
        if name in self.names:
            raise InvalidRequestError(f"adapter {name!r} is already loaded", "lora_name")
        adapter = read_adapter(name, path, self.shapes, self.max_rank, self._rename)
        key = hashlib.blake2b(f"lora:{next(self._ids)}:{name}".encode(), digest_size=16).digest()
        self.names[name] = key
        self.adapters[key] = adapter
        return adapter

    def unload(self, name: str) -> None:
        key = self.names.pop(name, None)
        if key is None:
            raise InvalidRequestError(f"no adapter {name!r} is loaded", "lora_name", "not_found")
        self._forget_if_unused(key)

    def key(self, name: str) -> bytes:
        """The prefix-cache key of the loaded adapter `name` (InvalidRequestError if none)."""
        if name not in self.names:
            raise InvalidRequestError(f"no adapter {name!r} is loaded", "model", "model_not_found")
        return self.names[name]

    def loaded(self) -> dict[str, str]:
        """name -> path of every loaded adapter."""
        return {name: self.adapters[key].path for name, key in self.names.items()}

    def _rename(self, peft_module: str) -> str | None:
        """A PEFT module path as the model's module name (its checkpoint renames applied)."""
        name = self.model.checkpoint_name(peft_module + ".weight")
        return name.removesuffix(".weight") if isinstance(name, str) else None

    # -- slots ------------------------------------------------------------------------------

    def slot_for(self, request_id: str, key: bytes) -> int:
        """The slot a request's tokens use (0: the base model), its adapter copied in first if
        it holds none; the request holds the slot until `release`."""
        if not key:
            return 0
        self.bound[request_id] = key
        if key not in self.slot_of:
            self._place(key)
        self.slot_of.move_to_end(key)
        return self.slot_of[key]

    def release(self, request_id: str) -> None:
        key = self.bound.pop(request_id, None)
        if key is not None:
            self._forget_if_unused(key)

    def _place(self, key: bytes) -> None:
        """Copy an adapter into a free slot, or the least recently used idle one's."""
        if not self.free:
            busy = set(self.bound.values())
            idle = next((k for k in self.slot_of if k not in busy), None)
            if idle is None:  # the scheduler runs at most max_loras adapters at once
                raise RuntimeError("every LoRA slot is held by a running request")
            self.free.append(self.slot_of.pop(idle))
        slot = self.free.pop()
        self._write(slot, self.adapters[key])
        self.slot_of[key] = slot

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        with torch.inference_mode():
            for name, (site, part) in self.sites.items():
                a, b = adapter.weights.get(name, (None, None))
                site.write(slot, part, a, b)

    def _forget_if_unused(self, key: bytes) -> None:
        """Drop an unloaded adapter's slot and weights once no running request holds it."""
        if key in self.names.values() or key in self.bound.values():
            return
        self.adapters.pop(key, None)
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.free.append(slot)

    # -- steps ------------------------------------------------------------------------------

    def set_step(self, slots: list[int]) -> None:
        """Each packed row's slot for the next forward."""
        self.tokens.set(slots)
