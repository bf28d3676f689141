"""LoRA adapters served beside one base model (S-LoRA / Punica style).

- `adapter.py`: a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) read
  and checked against the model's projections, on the host;
- `models/layers/lora.py`: per LoRA'd projection, stacked slot buffers A (slots, r_max, in) and
  B (slots, out, r_max) (slot 0 all zeros: the base model), applied after the base projection as
  y += B[slot] @ (A[slot] @ x) for each token's slot (kernels/lora.py);
- `manager.py`: the adapters the engine knows, which slot each holds (LRU among those no
  running request uses) and the per-token slot column of each step.
"""
