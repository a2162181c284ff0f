import time, torch
torch.set_num_threads(1)
x = torch.randn(1, 128, 256)
A = torch.ops.aten._assert_tensor_metadata.default
T = torch.ops.aten.to.dtype
def a(): A(x, dtype=torch.float32, device=torch.device("cpu"), layout=torch.strided)
def t(): T(x, torch.float32)
for f in (a, t):
    for _ in range(1000): f()
    best = []
    for r in range(5):
        s = time.process_time()
        for _ in range(20000): f()
        best.append((time.process_time() - s) / 20000 * 1e6)
    print(f.__name__, f"{sorted(best)[2]:.2f} us")
