import sys, torch
from torch.profiler import profile, ProfilerActivity
from kestrel.weights.shapes import random_model
from kestrel.engine.gpu_runner import GPURunner
from kestrel.engine.request import Request
from kestrel.engine.scheduler import ScheduledChunk
from kestrel.sampling import SamplingParams
from kestrel.config import CacheConfig

for name in sys.argv[1:]:
    model, _ = random_model(name, torch.bfloat16, torch.device("cuda"))
    r = GPURunner(model, torch.device("cuda"), 4, 512, 2048, CacheConfig(num_blocks=64), cuda_graphs=False)
    req = Request("a", list(range(128)), SamplingParams(temperature=0), 100)
    r.blocks.table("a")
    r.execute([ScheduledChunk(req, 128)]); req.num_computed = 128; req.output_ids.append(1)
    def step():
        r.execute([ScheduledChunk(req, 1)]); req.num_computed += 1; req.output_ids.append(1)
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): step()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages()]
    n = sum(e.count for e in ev if e.device_type.name == "CUDA")
    print(name, "kernels per step", n / 5, "layers", len(model.kv_layout()))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    del model, r
    torch.cuda.empty_cache()
