"""Use MLX's GPU only where it computes correctly; otherwise its CPU device.

GitHub's macOS arm64 runners are VMs with a paravirtual GPU: Metal
Performance Shaders are unsupported there and custom kernels have been seen
to return zeros. :func:`ensure_working_device` runs a few small kernels of the
kinds our models use (matmul, softmax, RMS norm, RoPE, attention) on the
default device, compares them with the same ops on the CPU stream, and falls
back to the CPU device (Accelerate BLAS on macOS) when any differs or raises.
It probes once per process; :func:`describe` says what it found.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceProbe:
    """The outcome of :func:`ensure_working_device` in this process."""

    device: str             # the default device afterwards: "gpu" or "cpu"
    gpu_checked: bool       # whether a GPU was there to check
    gpu_ok: bool | None     # its kernels matched the CPU's (None: no GPU)
    reason: str = ""


_probe: DeviceProbe | None = None
TOLERANCE = 1e-3  # float32 kernels on two devices differ by rounding, far below this


def ensure_working_device() -> DeviceProbe:
    """Probe the GPU once; make the CPU the default device if the GPU is absent or wrong.

    Returns:
        The :class:`DeviceProbe` (the same object on every later call).
    """
    global _probe
    if _probe is not None:
        return _probe
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        _probe = DeviceProbe("cpu", gpu_checked=False, gpu_ok=None, reason="no GPU device")
        return _probe
    try:
        worst = _max_kernel_error(mx)
        ok, reason = worst <= TOLERANCE, f"largest difference from the CPU: {worst:.3g}"
    except Exception as exc:  # a kernel that cannot even run on this GPU  # noqa: BLE001
        ok, reason = False, f"{type(exc).__name__}: {exc}"[:300]
    if not ok:
        mx.set_default_device(mx.cpu)
    _probe = DeviceProbe("gpu" if ok else "cpu", gpu_checked=True, gpu_ok=ok, reason=reason)
    return _probe


def _max_kernel_error(mx) -> float:
    key = mx.random.key(0)
    k1, k2, k3 = mx.random.split(key, 3)
    x = mx.random.normal((1, 4, 32, 64), key=k1)
    w = mx.random.normal((64, 64), key=k2)
    g = mx.random.normal((64,), key=k3)

    def kernels(stream):
        with mx.stream(stream):
            q = x @ w
            out = [
                q,
                mx.softmax(q, axis=-1),
                mx.fast.rms_norm(q, g, 1e-5),
                mx.fast.rope(q, 64, traditional=False, base=10000.0, scale=1.0, offset=3),
                mx.fast.scaled_dot_product_attention(q, x, x, scale=0.125, mask="causal"),
            ]
            mx.eval(out)
            return out

    gpu, cpu = kernels(mx.gpu), kernels(mx.cpu)
    return max(float(mx.max(mx.abs(a - b)).item()) for a, b in zip(gpu, cpu))


def describe() -> dict:
    """The probe's outcome for a results file's machine info (probing first if needed)."""
    p = ensure_working_device()
    return {"device": p.device, "gpu_checked": p.gpu_checked, "gpu_ok": p.gpu_ok, "reason": p.reason}
