"""Correctness of the Triton fast Hadamard transform on a CUDA GPU (skipped elsewhere).

The checks are against the float64 reference on the same (rounded) input, with tolerances
relative to max |y|: fp32 1e-5 (exact +-1 matmul products, fp32 sums and butterflies), fp16 2e-3
and bf16 1.6e-2 (one rounding of the output to the dtype: half an ulp is 2^-11 / 2^-8 of the
value, and max |y| bounds every |y|).
Triton is imported only once CUDA is known to be there: the CPU suite never imports triton.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Triton kernel needs a GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from edgeq.kernels.hadamard_ref import dense_hadamard, hadamard_ref  # noqa: E402
from edgeq.kernels.hadamard_triton import hadamard_transform, supported_by_kernel  # noqa: E402
from edgeq.runtime_ops import hadamard_matrix_for_fold  # noqa: E402

pytestmark = pytest.mark.gpu

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SIZES = [64, 128, 576, 1536, 4096, 11008, 14336]


def _check(x: torch.Tensor, **knobs) -> dict:
    y, info = hadamard_transform(x, return_info=True, **knobs)
    ref = hadamard_ref(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel() == 0:
        return info
    err = (y.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= REL_TOL[x.dtype] * scale, f"n={x.shape[-1]} {x.dtype}: err {err:.3e}, scale {scale:.3e}"
    return info


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference(n, dtype):
    x = torch.randn(37, n, device="cuda", generator=torch.Generator("cuda").manual_seed(n)).to(dtype)
    info = _check(x)
    assert info["used_triton"], f"n={n} fell back to torch"


@pytest.mark.parametrize("fp32_mode", ["split3", "tf32x3"])
@pytest.mark.parametrize("tile", [2048, 8192, 16384])
@pytest.mark.parametrize("n", [256, 576, 1536, 2048, 11008])
def test_kernel_tuning_knobs(n, tile, fp32_mode):
    """Tile sizes and both fp32 matmul modes are exact choices, not approximations."""
    x = torch.randn(9, n, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    info = _check(x, tile=tile, fp32_mode=fp32_mode)
    assert info["used_triton"] and info["tile"] == tile
    _check(x.bfloat16(), tile=tile, fp32_mode=fp32_mode, num_warps=4)


@pytest.mark.parametrize("n", [576, 1536, 4096])
def test_kernel_rank3_strided_and_scaled(n):
    g = torch.Generator("cuda").manual_seed(1)
    x = 100.0 * torch.randn(2, 5, n, device="cuda", generator=g)
    _check(x)
    _check(x.half()[:, ::2])  # non-contiguous leading dims
    _check(x[:, :0])  # zero rows
    out = torch.empty_like(x)
    assert hadamard_transform(x, out=out) is out
    torch.testing.assert_close(out.double(), hadamard_ref(x), rtol=0, atol=1e-5 * 100 * 4)


@pytest.mark.parametrize("n", [576, 1536, 11008])
def test_reference_is_the_folded_matrix(n):
    """The torch reference, and so the kernel, computes x @ hadamard_matrix_for_fold(n)."""
    x = torch.randn(3, n, device="cuda", dtype=torch.float64)
    h = torch.as_tensor(hadamard_matrix_for_fold(n), device="cuda")
    torch.testing.assert_close(hadamard_ref(x), x @ h, rtol=0, atol=1e-10)
    torch.testing.assert_close(dense_hadamard(n, device="cuda", dtype=torch.float64), h, rtol=0, atol=1e-15)


def test_unsupported_sizes():
    with pytest.raises(ValueError):
        hadamard_transform(torch.randn(2, 116, device="cuda"))
    assert not supported_by_kernel(48)  # 12 * 4: P < 16, so the torch path
    x = torch.randn(2, 48, device="cuda")
    y, info = hadamard_transform(x, return_info=True)
    assert not info["used_triton"]
    torch.testing.assert_close(y.double(), hadamard_ref(x), rtol=0, atol=1e-5)
