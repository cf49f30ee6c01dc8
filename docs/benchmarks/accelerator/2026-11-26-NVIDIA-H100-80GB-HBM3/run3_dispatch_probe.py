import time, numpy as np, jax, jax.numpy as jnp
print(jax.devices())
params = [jnp.ones((64, 256), jnp.float32) * i for i in range(24)]
kv = jnp.zeros((2, 4096, 16, 64), jnp.float32)
meta = [np.arange(n, dtype=np.int32) for n in (4096, 8192, 1024)]
def body(kv, params, m0, m1, m2):
    s = sum(p.sum() for p in params)
    kv = kv.at[0, m0 % 4096].add(s)
    return kv, (m1[:256] + m2[:256] + s.astype(jnp.int32))
for donate in (False, True):
    f = jax.jit(body, donate_argnums=(0,) if donate else ())
    for mode in ("numpy", "device"):
        args = meta if mode == "numpy" else [jax.device_put(m) for m in meta]
        kv, out = f(kv, params, *args); out.block_until_ready()
        t = time.perf_counter(); n = 200
        for _ in range(n):
            kv, out = f(kv, params, *args)
        t1 = time.perf_counter(); out.block_until_ready(); t2 = time.perf_counter()
        print(f"donate={donate} {mode}: {1e6*(t1-t)/n:.0f} us/call dispatch, {1e6*(t2-t)/n:.0f} us/call total", flush=True)
t = time.perf_counter()
for _ in range(200): d = [jax.device_put(m) for m in meta]
print(f"device_put 3 arrays: {1e6*(time.perf_counter()-t)/200:.0f} us")
g = jax.jit(lambda *p: sum(q.sum() for q in p))
g(*params).block_until_ready(); t = time.perf_counter()
for _ in range(200): r = g(*params)
print(f"24-arg call: {1e6*(time.perf_counter()-t)/200:.0f} us")
