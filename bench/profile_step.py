"""Profile one qtrain training step on the GPU: top CUDA kernels and CPU ops, to see where time goes.

    PYTHONPATH=. python3 bench/profile_step.py Qwen2.5-0.5B 16 2 4
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from qtrain.train.options import Options
from qtrain.train.trainer import Trainer

model, batch, accum, chunks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tr = Trainer(Options(model=model, from_scratch=True, batch_size=batch, seq_len=1024, grad_accumulation=accum,
                     lmhead_chunks=chunks, compile="on", device="cuda", learning_rate=1e-4))
x = torch.randint(0, tr.cfg.vocab_size, (batch, 1025), device="cuda")
inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()


def step():
    for _ in range(accum):
        tr.micro_step(inp, tgt, loss_scale=1.0 / (batch * 1024 * accum))
    tr.update(lr=1e-4)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
