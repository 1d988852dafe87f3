"""The pure-torch bert_padding fallback against flash-attn's semantics, written as loops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oldgpu.patch.runtime import compat  # noqa: E402 (needs torch)


def ref_unpad(x, mask, unused=None):
    """flash_attn.bert_padding.unpad_input (flash-attn >= 2.6), element by element."""
    batch, seqlen = mask.shape
    keep = mask if unused is None else mask + unused
    rows, indices, seqlens, used = [], [], [], []
    for b in range(batch):
        n = 0
        for s in range(seqlen):
            if keep[b, s]:
                rows.append(x[b, s])
                indices.append(b * seqlen + s)
                n += 1
        seqlens.append(n)
        used.append(int(mask[b].sum()))
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    values = torch.stack(rows) if rows else x.new_zeros((0, *x.shape[2:]))
    return values, indices, cu, max(seqlens), used


def ref_pad(values, indices, batch, seqlen):
    out = values.new_zeros((batch * seqlen, *values.shape[1:]))
    for row, index in zip(values, indices, strict=True):
        out[index] = row
    return out.reshape(batch, seqlen, *values.shape[1:])


def random_mask(gen, batch, seqlen):
    """Left- and right-padded rows, a full row and an empty row."""
    mask = torch.zeros(batch, seqlen, dtype=torch.int64)
    for b in range(batch):
        n = int(torch.randint(1, seqlen + 1, (1,), generator=gen))
        if b % 2:
            mask[b, seqlen - n :] = 1  # left padding, like verl's prompts
        else:
            mask[b, :n] = 1
    mask[0] = 1
    if batch > 2:
        mask[2] = 0
    return mask


SHAPES = [(), (1,), (8,), (3, 5)]


@pytest.mark.parametrize("tail", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unpad_matches_reference(tail, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen = 5, 7
    x = torch.randn(batch, seqlen, *tail, generator=gen)
    mask = random_mask(gen, batch, seqlen)
    values, indices, cu, max_len, used = compat.unpad_input(x, mask)
    r_values, r_indices, r_cu, r_max, r_used = ref_unpad(x, mask)
    assert torch.equal(values, r_values)
    assert indices.tolist() == r_indices and indices.dtype == torch.int64
    assert cu.tolist() == r_cu and cu.dtype == torch.int32
    assert max_len == r_max and isinstance(max_len, int)
    assert used.tolist() == r_used and used.dtype == torch.int32


def test_unpad_with_unused_mask():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 2, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0]] * 4)
    unused = torch.tensor([[0, 0, 1, 0, 0, 0]] * 4)
    values, indices, cu, max_len, used = compat.unpad_input(x, mask, unused)
    r_values, r_indices, r_cu, r_max, r_used = ref_unpad(x, mask, unused)
    assert torch.equal(values, r_values) and indices.tolist() == r_indices
    assert cu.tolist() == r_cu and max_len == r_max == 3 and used.tolist() == r_used == [2] * 4


def test_verl_call_shapes():
    """How verl 0.5.0 calls them: ids unsqueezed, `ids, indices, cu_seqlens, *_ = ...`."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 100, (3, 9), generator=gen)
    mask = random_mask(gen, 3, 9)
    input_ids_rmpad, indices, cu_seqlens, *_ = compat.unpad_input(ids.unsqueeze(-1), mask)
    assert input_ids_rmpad.shape == (int(mask.sum()), 1) and input_ids_rmpad.dtype == ids.dtype
    position_ids = torch.arange(9).expand(3, 9)
    pos_rmpad = compat.rearrange(
        compat.index_first_axis(
            compat.rearrange(position_ids.unsqueeze(-1), "b s ... -> (b s) ..."), indices
        ),
        "(b s) ... -> b s ...",
        b=1,
    )
    assert pos_rmpad.shape == (1, int(mask.sum()), 1)
    mrope = torch.randn(3, 3, 9, generator=gen)  # (c, b, s): qwen2-vl positions
    rows = compat.index_first_axis(compat.rearrange(mrope, "c b s ... -> (b s) c ..."), indices)
    assert torch.equal(rows, mrope.permute(1, 2, 0).reshape(27, 3)[indices])
    back = compat.pad_input(
        hidden_states=input_ids_rmpad, indices=indices, batch=3, seqlen=9
    ).squeeze(-1)
    assert torch.equal(back, ids * mask)
    assert cu_seqlens[-1] == mask.sum()


@pytest.mark.parametrize("tail", SHAPES)
def test_pad_matches_reference_and_round_trips(tail):
    gen = torch.Generator().manual_seed(5)
    batch, seqlen = 4, 6
    x = torch.randn(batch, seqlen, *tail, generator=gen)
    mask = random_mask(gen, batch, seqlen)
    values, indices, *_ = compat.unpad_input(x, mask)
    padded = compat.pad_input(values, indices, batch, seqlen)
    assert torch.equal(padded, ref_pad(values, indices.tolist(), batch, seqlen))
    broadcast = mask.reshape(batch, seqlen, *([1] * len(tail))).to(x.dtype)
    assert torch.equal(padded, x * broadcast)


def test_gradient_flows_through_index_first_axis():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(10, 3, generator=gen, requires_grad=True)
    indices = torch.tensor([7, 0, 3, 9])
    weight = torch.randn(4, 3, generator=gen)
    (compat.index_first_axis(x, indices) * weight).sum().backward()
    expected = torch.zeros(10, 3)
    for row, index in enumerate(indices.tolist()):
        expected[index] = weight[row]
    assert torch.equal(x.grad, expected)


def test_gradient_flows_through_unpad_and_pad():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 2, generator=gen, requires_grad=True)
    mask = random_mask(gen, 3, 5)
    values, indices, *_ = compat.unpad_input(x, mask)
    out = compat.pad_input(values * 2, indices, 3, 5)
    out.sum().backward()
    assert torch.equal(x.grad, 2 * mask.unsqueeze(-1).expand(3, 5, 2).to(x.dtype))


def test_rearrange_fallback_patterns():
    rearrange = compat._einops_rearrange
    t = torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    assert torch.equal(rearrange(t, "b s ... -> (b s) ..."), t.reshape(6, 4, 5))
    assert torch.equal(
        rearrange(t, "c b s ... -> (b s) c ..."), t.permute(1, 2, 0, 3).reshape(12, 2, 5)
    )
    flat = t.reshape(6, 4, 5)
    assert torch.equal(rearrange(flat, "(b s) ... -> b s ...", b=2), t)
    assert torch.equal(rearrange(t, "a b c d -> d c b a"), t.permute(3, 2, 1, 0))
    with pytest.raises(ValueError):
        rearrange(t, "a b -> b a")
    with pytest.raises(ValueError):
        rearrange(t, "a b c d -> a b c")
