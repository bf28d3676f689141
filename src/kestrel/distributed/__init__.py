"""Models larger than one device: tensor parallel on torch.distributed (NCCL on CUDA, gloo on the
CPU). `group.py` sets the process group up; `tensor_parallel.py` holds the parallel layers and
shards a loaded model onto this rank."""
