"""The attention benchmark's kernels agree with plain softmax attention, and run() reports its keys."""

from __future__ import annotations

import argparse

import pytest
import torch

from backends import get_backend
from odma.bench import attention_bench as ab
from odma.errors import ConfigError


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ab.add_arguments(p)
    args = p.parse_args([])
    vars(args).update(dict(contexts="64,128", batch=3, q_heads=6, kv_heads=2, head_dim=8, tiles="16,64",
                           repeats=1, memcpy_mib=1), **kw)
    return args


def _reference(c) -> list[torch.Tensor]:
    out = []
    for i in range(len(c.blocks)):
        k, v = c.contiguous_kv(i)  # [context, kv_heads, head_dim]
        for h in range(k.shape[1]):
            s = (c.q[i, h] @ k[:, h].T) * c.scale  # [group, context]
            out.append(torch.softmax(s, -1) @ v[:, h])
    return out


@pytest.mark.parametrize("tile", [16, 48, 64, 256])
def test_paged_and_tiled_kernels_match_plain_attention(tile):
    c = ab._Caches(get_backend("cpu"), ab.Shape(3, 6, 2, 8), 128, torch.float32, torch.Generator().manual_seed(1))
    ref = torch.stack(_reference(c))
    for got in (ab.contiguous_attention(c), ab.paged_attention(c, tile), ab.contiguous_tiled_attention(c, tile)):
        assert torch.allclose(torch.stack(got).flatten(0, 1), ref, atol=1e-5)


def test_paged_pages_hold_the_same_values_as_the_blocks():
    c = ab._Caches(get_backend("cpu"), ab.Shape(2, 4, 2, 4), 64, torch.float32, torch.Generator().manual_seed(2))
    for i in range(2):
        k, v = c.contiguous_kv(i)
        assert torch.equal(c.k_pages[c.table[i]].flatten(0, 1), k)
        assert torch.equal(c.v_pages[c.table[i]].flatten(0, 1), v)
    assert len(set(c.table.flatten().tolist())) == c.table.numel()  # no page shared between sequences


def test_run_reports_every_key():
    result = ab.run(_args())
    for key in ("contiguous_ms_", "paged_ms_", "speedup_", "contiguous_gbps_", "paged_gbps_", "max_abs_diff_"):
        assert key + "128" in result and key + "64" in result
    assert result["device"] == "cpu" and result["memcpy_gbps"] > 0
    assert result["max_abs_diff_128"] < 1e-4


def test_bad_shapes_are_config_errors():
    with pytest.raises(ConfigError):
        ab.run(_args(q_heads=5))
    with pytest.raises(ConfigError):
        ab.run(_args(contexts="100"))
