"""The dispatch layer: torch twins on CPU, Triton on CUDA, CRESCENT_KERNELS to force."""

import subprocess
import sys
import textwrap

import pytest
import torch

import kernels
from kernels import dispatch
from kernels import reference as ref
from kernels.testing import make_paged_kv

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return monkeypatch


def test_auto_picks_torch_on_cpu_and_triton_on_cuda(env):
    assert kernels.select_backend(CPU) == "torch"
    assert kernels.select_backend(CUDA) == ("triton" if kernels.triton_available() else "torch")
    env.setattr(dispatch, "triton_available", lambda: False)
    assert kernels.select_backend(CUDA) == "torch"


@pytest.mark.parametrize("value,device,want", [("torch", CUDA, "torch"), ("TORCH", CPU, "torch"), ("auto", CPU, "torch")])
def test_env_forces_backend(env, value, device, want):
    env.setenv(dispatch.ENV_VAR, value)
    assert kernels.select_backend(device) == want


def test_env_triton_on_cpu_needs_the_interpreter(env):
    pytest.importorskip("triton")
    env.setenv(dispatch.ENV_VAR, "triton")
    assert kernels.select_backend(CPU) == "triton"
    env.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.select_backend(CPU)


def test_env_triton_without_triton_and_bad_values_raise(env):
    env.setenv(dispatch.ENV_VAR, "triton")
    env.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        kernels.select_backend(CUDA)
    env.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="CRESCENT_KERNELS"):
        kernels.select_backend(CPU)


def _boom(*args, **kwargs):
    raise AssertionError("wrong backend called")


def _pages_args():
    ks = [torch.randn(6, 16, 2, 32) for _ in range(2)]
    vs = [torch.randn(6, 16, 2, 32) for _ in range(2)]
    return ks, vs, torch.tensor([4, 1], dtype=torch.int32)


def test_public_functions_run_the_twins_on_cpu(env):
    pytest.importorskip("triton")
    from kernels import kv_pages

    env.setattr(kv_pages, "gather_kv_pages", _boom)
    env.setattr(kv_pages, "scatter_kv_layer", _boom)
    ks, vs, page_ids = _pages_args()
    chunk = kernels.gather_kv_pages(ks, vs, page_ids)
    assert torch.equal(chunk, ref.gather_kv_pages(ks, vs, page_ids))
    # the landing kernel's twin: no address table, the same pages back from the chunk's layer 1
    assert kernels.source_table([chunk], torch.device("cpu")) is None
    k, v = torch.zeros_like(ks[1]), torch.zeros_like(vs[1])
    layer_words = chunk[1].numel() * 4 // 8
    kernels.scatter_kv_layer([chunk], k, v, page_ids[None], offset_words=layer_words)
    assert torch.equal(k[page_ids.long()], ks[1][page_ids.long()]) and torch.equal(v[page_ids.long()], vs[1][page_ids.long()])


def test_forced_triton_runs_the_kernels_on_cpu(env):
    pytest.importorskip("triton")
    env.setenv(dispatch.ENV_VAR, "triton")
    for name in (
        "gather_kv_pages", "scatter_kv_pages", "scatter_kv_chunks", "scatter_kv_layer", "quantize_kv_fp8",
        "dequantize_kv_fp8", "chunked_prefill_attention", "paged_decode_attention",
    ):  # fmt: skip
        env.setattr(ref, name, _boom)
    ks, vs, page_ids = _pages_args()
    chunk = kernels.gather_kv_pages(ks, vs, page_ids)
    kernels.scatter_kv_pages(chunk, ks, vs, page_ids)
    halves = torch.stack([chunk[0, :, :, :16], chunk[0, :, :, 16:]])  # layer 0 as two one-page chunks
    kernels.scatter_kv_chunks(halves, ks[0], vs[0], page_ids[:, None].contiguous())
    parts = [h.contiguous() for h in halves]
    table = kernels.source_table(parts, torch.device("cpu"))
    assert table is not None and table.tolist() == [p.data_ptr() for p in parts]
    shares = kernels.scatter_kv_layer(parts, ks[0], vs[0], page_ids[:, None].contiguous(), wsum_at=0, wsum_k=3,
                                      table=table)
    assert shares.shape == (2,) and shares.dtype == torch.int64
    q8, scales = kernels.quantize_kv_fp8(chunk)
    assert kernels.dequantize_kv_fp8(q8, scales, torch.float32).shape == chunk.shape

    paged = make_paged_kv([5, 20], 2, 32, 16, torch.float16)
    q = torch.randn(2, 4, 32, dtype=torch.float16)
    seq_lens = torch.tensor([5, 20], dtype=torch.int32)
    decode = kernels.paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, seq_lens, 0.2)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = kernels.chunked_prefill_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, cu, seq_lens - 1, 0.2, max_q_len=1
    )
    torch.testing.assert_close(prefill, decode)


def test_kernels_import_and_run_without_triton():
    """A blocked `import triton`: the package imports, dispatches to torch, never loads triton."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked")
        sys.meta_path.insert(0, Block())
        import torch, kernels
        assert not kernels.triton_available()
        assert kernels.select_backend(torch.device("cuda")) == "torch"
        ks = [torch.randn(4, 16, 1, 16)]
        chunk = kernels.gather_kv_pages(ks, ks, torch.tensor([2], dtype=torch.int32))
        q, s = kernels.quantize_kv_fp8(chunk)
        assert "triton" not in sys.modules
        print("ok")
        """
    )
    env = {"PATH": "/usr/bin:/bin", "CRESCENT_KERNELS": "auto"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
