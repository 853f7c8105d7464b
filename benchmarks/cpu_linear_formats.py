"""The decoder layers' weight matmuls of SmolLM2-135M at batch 1 on the CPU, by weight format:
fp32 / bf16 F.linear, int8 (aten._weight_int8pack_mm) and int4 (aten._weight_int4pack_mm_for_cpu),
30 layers of distinct random weights (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576)
so the weights do not sit in cache, one token; median and min of 20 passes, in ms.

    .venv/bin/python benchmarks/cpu_linear_formats.py 1     # threads

Measured on the project's 2-core AMD EPYC (shared, load average ~5), 1 thread, 2026-11-23:
fp32 36.3 ms, bf16 23.9, int8 19.6, int4 16.0 (median). With 2 threads on the loaded machine
every at::parallel_for kernel waited ~8 ms per call for its second thread (bf16/int8/int4
~950 ms), while fp32 (oneDNN, no parallel region at M=1) did not.
"""
import torch, time, sys
torch.set_num_threads(int(sys.argv[1]))
L=30; shapes=[(576,960),(576,576),(576,3072),(1536,576)]
def run(fmt):
    layers=[]
    for _ in range(L):
        ws=[]
        for K,N in shapes:
            if fmt in ('fp32','bf16','fp16'):
                dt=dict(fp32=torch.float32,bf16=torch.bfloat16,fp16=torch.float16)[fmt]
                w=torch.randn(N,K,dtype=dt); ws.append(lambda x,w=w: torch.nn.functional.linear(x,w))
            elif fmt.startswith('i8'):
                w=torch.randint(-128,127,(N,K),dtype=torch.int8); s=torch.rand(N,dtype=torch.bfloat16)
                ws.append(lambda x,w=w,s=s: torch.ops.aten._weight_int8pack_mm(x,w,s))
            else:
                wp=torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0,16,(N,K),dtype=torch.int32),1)
                sz=torch.rand(K//32,N,2,dtype=torch.bfloat16)
                ws.append(lambda x,w=wp,s=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x,w,32,s))
        layers.append(ws)
    dt=torch.float32 if fmt in('fp32',) else (torch.float16 if fmt=='fp16' else torch.bfloat16)
    xs={K:torch.randn(1,K,dtype=dt) for K,_ in shapes}
    def step():
        for ws in layers:
            for (K,N),f in zip(shapes,ws): f(xs[K])
    for _ in range(3): step()
    ts=[]
    for _ in range(20):
        t=time.perf_counter(); step(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3, ts[0]*1e3
for fmt in ['fp32','bf16','i8','i4']:
    print(fmt, 'median %.2f ms  min %.2f ms'%run(fmt), flush=True)
