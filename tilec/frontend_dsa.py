"""Lowering of the DSA prelude (GLM-5 / DeepSeek-V3.2): FP8 GEMMs, MLA absorption, paged caches.

A mixin of :class:`tilec.frontend.Lowering`. The plain-torch forms recognized here are those of
``examples/glm5_dsa_prelude.py``: act_quant / act_dequant / weight_dequant (DeepSeek-V3's FP8
recipe written in torch ops), einsum for MLA's absorption, index_put / index_copy at a
slot-mapping input, and the lightning indexer's score over pages gathered through a block table.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .errors import InputError
from .fxgraph import CASTS, INDEX_WRITES, RESHAPES, VIEW_OPS, Static, aten, is_call, val_of
from .ir import BufferKind, Op, View, contiguous_strides, is_integer


class DsaLowering:
    """FP8 quantization, dequantized GEMMs, einsum absorption, paged cache writes and the indexer
    score, lowered for :class:`tilec.frontend.Lowering` (which provides ``value``, ``_emit``, ...)."""

    def _upcast_src(self, n):
        """Strips widening casts to float32 (exact): the node whose value they widen."""
        while is_call(n, *CASTS, aten.alias.default) and val_of(n) is not None and val_of(n).dtype == torch.float32:
            n = n.args[0]
        return n

    def _apply_view(self, src: View, node: fx.Node) -> View:
        """The view ``node`` (a view op) takes of ``src``, as a strided View of src's buffer."""
        buf = self.buffers[src.buffer]
        meta = torch.empty(buf.numel, dtype=buf.dtype, device="meta").as_strided(src.shape, src.strides, src.offset)
        out = meta.view(val_of(node).shape) if node.target in RESHAPES else node.target(meta, *node.args[1:],
                                                                                         **node.kwargs)
        return View(src.buffer, tuple(out.shape), tuple(out.stride()), out.storage_offset(), src.pos_stride)

    def _fp8_scale(self, s):
        """``amax(|v|, -1, keepdim).clamp(min=a) / 448`` or ``* (1 / 448)`` (recip: another float32
        value, kept as written) (or ``exp2(ceil(log2(...)))`` of it, a power-of-two scale)
        -> ``(v node, pow2, a, recip)`` or None."""
        pow2 = False
        if is_call(s, aten.exp2.default) and is_call(s.args[0], aten.ceil.default) and is_call(s.args[0].args[0], aten.log2.default):
            s, pow2 = s.args[0].args[0].args[0], True
        if is_call(s, aten.div.Tensor) and not isinstance(s.args[1], fx.Node) and float(s.args[1]) == 448.0:
            base, recip = s.args[0], False
        elif is_call(s, aten.mul.Tensor) and not isinstance(s.args[1], fx.Node) and float(s.args[1]) == 1.0 / 448.0:
            base, recip = s.args[0], True
        else:
            return None
        amin = 0.0
        if is_call(base, aten.clamp.default, aten.clamp_min.default):
            if len(base.args) > 2 and base.args[2] is not None or isinstance(base.args[1], fx.Node):
                return None
            base, amin = base.args[0], float(base.args[1])
        if not (is_call(base, aten.amax.default) and len(base.args) > 2 and base.args[2]
                and list(base.args[1]) in ([-1], [len(val_of(base).shape) - 1]) and is_call(base.args[0], aten.abs.default)):
            return None
        return base.args[0].args[0], pow2, amin, recip

    def _fp8_quant_parts(self, node):
        """``to_fp8(clamp(v / s, -448, 448))`` with ``v = view(x.float())`` [..., K/G, G] and s its
        :meth:`_fp8_scale` -> ``(x node, s node, G, pow2, amin, recip)`` or None."""
        if not (is_call(node, *CASTS) and val_of(node) is not None and val_of(node).dtype == torch.float8_e4m3fn):
            return None
        c = node.args[0]
        if is_call(c, aten.clamp.default):
            if tuple(c.args[1:3]) != (-448.0, 448.0):
                return None
            c = c.args[0]
        if not (is_call(c, aten.div.Tensor) and isinstance(c.args[1], fx.Node)):
            return None
        v, s = c.args
        sc = self._fp8_scale(s)
        if sc is None or sc[0] is not v or not is_call(v, *RESHAPES):
            return None
        x = self._upcast_src(v.args[0])
        xs, vs = tuple(val_of(x).shape), tuple(val_of(v).shape)
        if len(vs) < 2 or vs[:-2] != xs[:-1] or vs[-2] * vs[-1] != xs[-1]:
            return None
        return x, s, vs[-1], sc[1], sc[2], sc[3]

    def _fp8_quant(self, node: fx.Node):
        """Per-group FP8 quantization -> one ``fp8_quant`` op with two outputs: the values
        (this node's value) and the scales (bound to the scale node)."""
        m = self._fp8_quant_parts(node)
        if m is None:
            return None
        x_n, s_n, group, pow2, amin, recip = m
        x = self.view_of(x_n)
        lead, k = x.shape[:-1], x.shape[-1]
        qbuf = self._new_buffer(f"{node.name}_q", lead + (k,), torch.float8_e4m3fn, node=node)
        sbuf = self._new_buffer(f"{node.name}_scale", lead + (k // group,), torch.float32, node=node)
        self.ops.append(Op(self._name(f"fp8_quant_{node.name}"), "fp8_quant", (x,), (View.whole(qbuf), View.whole(sbuf)),
                           (("amin", amin), ("group", group), ("pow2", pow2), ("recip", recip)), self._prov(node)))
        sshape = tuple(val_of(s_n).shape)
        self.env[s_n] = View(sbuf.name, sshape, contiguous_strides(sshape))
        shape = tuple(val_of(node).shape)
        return View(qbuf.name, shape, contiguous_strides(shape))

    def _fp8_quant_scale(self, node: fx.Node):
        """The scale of an FP8 quantization demanded before its values: lowers the quantization."""
        if self._fp8_scale(node) is None:
            return None
        for div in node.users:
            for c in [div, *div.users]:
                for cast in c.users:
                    m = self._fp8_quant_parts(cast)
                    if m is not None and m[1] is node:
                        self.value(cast)
                        return self.env[node]
        return None

    def _act_dequant(self, n):
        """``view(view(q.float()) * scale.unsqueeze(-1))`` (FP8 values per group of G) -> (q, scale, G) or None."""
        if not (is_call(n, *RESHAPES) and is_call(n.args[0], aten.mul.Tensor)):
            return None
        mul = n.args[0]
        for a, b in (mul.args, mul.args[::-1]):
            if not (is_call(a, *RESHAPES) and is_call(b, aten.unsqueeze.default)):
                continue
            q, s = self._upcast_src(a.args[0]), b.args[0]
            qv, av, sv = val_of(q), val_of(a), val_of(s)
            if qv is None or sv is None or qv.dtype != torch.float8_e4m3fn or b.args[1] not in (-1, len(av.shape) - 1):
                continue
            # groups of G along q's last dim only, one scale each: [*lead, K] -> [*lead, K/G, G] * [*lead, K/G, 1]
            # (another grouping - a row's scales laid out over two rows, or flattened - is another computation:
            # planned as one, it was silently wrong, rel. L2 0.46 - a fresh user's finding)
            lead, k, g = tuple(qv.shape[:-1]), qv.shape[-1], av.shape[-1]
            if k % g == 0 and tuple(av.shape) == (*lead, k // g, g) and tuple(sv.shape) == (*lead, k // g) \
                    and tuple(qv.shape) == tuple(val_of(n).shape):
                return q, s, g
        return None

    def _weight_dequant(self, n):
        """``w.float() * S`` where S broadcasts a ``[ceil(N/Br), ceil(K/Bc)]`` scale over Br x Bc
        blocks of the FP8 weight w [N, K] (``scale[:, None, :, None].expand(...).reshape(...)[:N, :K]``),
        both module parameters -> (w, scale, (Br, Bc)) or None."""
        if not is_call(n, aten.mul.Tensor):
            return None
        for a, s in (n.args, n.args[::-1]):
            w = self._upcast_src(a) if is_call(a, *CASTS) else None
            if w is None or val_of(w) is None or val_of(w).dtype != torch.float8_e4m3fn or val_of(w).dim() != 2:
                continue
            while is_call(s, aten.alias.default, aten.clone.default, *RESHAPES) or (is_call(s, aten.slice.Tensor)
                                                                               and s.args[2] in (0, None)):
                s = s.args[0]
            if not is_call(s, aten.expand.default) or len(s.args[1]) != 4:
                continue
            nb, br, kb, bc = (int(x) for x in s.args[1])
            u = s.args[0]
            if tuple(val_of(u).shape) != (nb, 1, kb, 1):
                continue
            while is_call(u, aten.unsqueeze.default):
                u = u.args[0]
            n_, k_ = val_of(w).shape
            weights = all(v.op == "placeholder" and (v.name in self.b.params or v.name in self.b.consts) for v in (w, u))
            if weights and tuple(val_of(u).shape) == (nb, kb) and -(-n_ // br) == nb and -(-k_ // bc) == kb \
                    and tuple(val_of(n).shape) == (n_, k_):  # read-only weights: device tiles may use __ldg
                return w, u, (br, bc)
        return None

    def _fp8_linear(self, node: fx.Node):
        """``linear(act_dequant(xq, xs), weight_dequant(wq, ws))`` (optionally cast to the
        activation dtype) -> one block-scaled ``fp8_linear`` reading the FP8 tensors."""
        lin = node.args[0] if is_call(node, *CASTS) and isinstance(node.args[0], fx.Node) else node
        if not is_call(lin, aten.linear.default) or (len(lin.args) > 2 and lin.args[2] is not None):
            return None
        xa, wd = self._act_dequant(lin.args[0]), self._weight_dequant(lin.args[1])
        if xa is None or wd is None:
            return None
        (xq, xs, group), (wq, ws, (br, bc)) = xa, wd
        if group != bc:
            self._unsupported(node, f"FP8 linear with activation groups of {group} but weight blocks of {bc} along K")
        inputs = [self.view_of(xq), self.view_of(xs), self.view_of(wq), self.view_of(ws)]
        return self._emit(node, "fp8_linear", inputs, attrs=(("block_n", br),))

    def _dequant_view_chain(self, n):
        """View ops (and at most one cast) over a :meth:`_weight_dequant` ->
        (w, scale, block, view nodes in order, cast dtype or None) or None."""
        chain, cast = [], None
        while True:
            wd = self._weight_dequant(n)
            if wd is not None:
                return (*wd, chain[::-1], cast)
            if is_call(n, *VIEW_OPS) and n.target is not aten.expand.default:
                chain.append(n)
            elif is_call(n, *CASTS) and cast is None:
                cast = val_of(n).dtype
            else:
                return None
            n = n.args[0]

    def _einsum(self, node: fx.Node):
        """A two-operand einsum with one batch, one contracted and one free letter per side
        (``thd,hdc->thc``: MLA's absorption) -> ``bmm``; the right operand may be a view of a
        block-scaled FP8 weight (read in place, dequantized in the tile)."""
        if not is_call(node, aten.einsum.default):
            return None
        eq, operands = node.args[0].replace(" ", ""), node.args[1]
        if len(operands) != 2 or "->" not in eq or "." in eq:
            self._unsupported(node, f"einsum {eq!r}: only two-operand batched matmuls are supported")
        lhs, out = eq.split("->")
        sa, sb = lhs.split(",")
        batch = [c for c in out if c in sa and c in sb]
        contract = [c for c in sa if c in sb and c not in out]
        fa = [c for c in out if c in sa and c not in sb]
        fb = [c for c in out if c in sb and c not in sa]
        if any(len(set(x)) != len(x) for x in (sa, sb, out)) or not len(batch) == len(contract) == len(fa) == len(fb) == 1 \
                or len(sa) != 3 or len(sb) != 3:
            self._unsupported(node, f"einsum {eq!r} is not a batched matmul (one batch, one contracted and one free "
                                    f"letter per operand)")

        def permute(v: View, letters: str, order) -> View:
            idx = [letters.index(c) for c in order]
            return View(v.buffer, tuple(v.shape[i] for i in idx), tuple(v.strides[i] for i in idx), v.offset,
                        v.pos_stride)

        a = permute(self.view_of(operands[0]), sa, batch + fa + contract)
        out_dtype = val_of(node).dtype
        attrs: tuple = ()
        inputs = [a]
        dq = self._dequant_view_chain(operands[1])
        if dq is None:
            inputs.append(permute(self.view_of(operands[1]), sb, batch + contract + fb))
        else:
            wq, ws, block, chain, cast = dq
            w = self.view_of(wq)
            for vn in chain:
                w = self._apply_view(w, vn)
            if cast not in (None, torch.float32, out_dtype):
                self._unsupported(node, f"dequantized weight cast to {cast}, the einsum computes in {out_dtype}")
            inputs += [permute(w, sb, batch + contract + fb), self.view_of(ws)]
            attrs = (("block", block), ("round_w", cast not in (None, torch.float32)),
                     ("row_len", self.buffers[w.buffer].shape[-1]))
        sizes = {c: s for c, s in zip(out, val_of(node).shape)}
        buf = self._new_buffer(node.name, tuple(sizes[c] for c in out), out_dtype, node=node)
        whole = View.whole(buf)
        self.ops.append(Op(self._name(f"bmm_{node.name}"), "bmm", tuple(inputs),
                           (permute(whole, out, batch + fa + fb),), attrs, self._prov(node)))
        return whole

    def _check_positions_listed(self, idx_n: fx.Node, cache: View) -> None:
        """Raises :class:`InputError` when the index of a write into ``cache`` that tilec cannot
        lower as a slot write is computed from one-element integer arguments that ``positions``
        does not list: such an argument is most likely the decode position, which positions names
        wrongly or not at all. Returns otherwise (a per-call index of several slots, say), and the
        caller reports the node as unsupported."""
        seen, stack = set(), [idx_n]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack += n.all_input_nodes
        names = {n.name for n in seen if n.op == "placeholder" and isinstance(val_of(n), torch.Tensor)
                 and val_of(n).numel() == 1 and not val_of(n).dtype.is_floating_point
                 and not val_of(n).dtype.is_complex and val_of(n).dtype != torch.bool}
        unlisted = [self._argument(a) for a in self.b.user_inputs if a in names and a not in self.b.positions]
        if unlisted:
            listed = sorted(self.b.user_inputs.index(a) for a in self.b.positions)
            raise InputError(f"the cache write into {self._argument(cache.buffer)} takes its index from "
                             f"{', '.join(unlisted)}, which positions {listed} does not list: if it holds the decode "
                             f"position, list it in positions (tilec cannot lower a write at an index that is not "
                             f"a position)")

    def _paged_cache_write(self, node: fx.Node):
        """``cache.view(-1, D)[slot_mapping] = src`` (``index_put`` / ``index_copy`` along dim 0 at a
        per-call slot tensor) -> ``paged_cache_write``, in place into the caller's cache."""
        if not is_call(node, *INDEX_WRITES):
            return None
        if node.target in (aten.index_copy.default, aten.index_copy_.default):
            dim, idx_n, src_n = node.args[1], node.args[2], node.args[3]
        else:
            indices, src_n = node.args[1], node.args[2]
            if len(indices) != 1 or node.args[3:4] == (True,):
                return None
            dim, idx_n = 0, indices[0]
        if not isinstance(idx_n, fx.Node) or self.cls[idx_n] != "runtime":
            return None  # a write at the decode position: _index_write
        src, idx = self.view_of(src_n), self.view_of(idx_n)
        if node.target not in (aten.index_copy.default, aten.index_copy_.default) and len(idx.shape) == 1 \
                and tuple(src.shape) == tuple(val_of(node.args[0]).shape[1:]):
            # index_put broadcasts one row over the slots (with one slot, torch.export drops src's dim)
            src = View(src.buffer, (idx.shape[0], *src.shape), (0, *src.strides), src.offset, src.pos_stride)
        feat = tuple(src.shape[1:])
        base = node.args[0]  # the cache in its own shape: look through the flattening reshape
        while is_call(base, *RESHAPES) and val_of(base.args[0]).numel() == val_of(base).numel() \
                and tuple(val_of(base.args[0]).shape[len(val_of(base.args[0]).shape) - len(feat):]) == feat:
            base = base.args[0]
        dst = self.view_of(base)
        if self.buffers[dst.buffer].kind is not BufferKind.STATE:
            self._unsupported(node, "slot write into a tensor that is not a graph input updated in place (a cache)")
        if dst.buffer in self.state_writes:
            self._unsupported(node, f"a second write into {self._argument(dst.buffer)} in one step (tilec plans one "
                                    f"in-place write per cache and step: write all of the step's rows at once)")
        rows = val_of(node.args[0]).shape[0]
        if dim % val_of(node.args[0]).dim() != 0 or len(feat) > 1 or len(idx.shape) != 1 or src.shape[0] != idx.shape[0] \
                or rows != val_of(base).numel() // max(1, math.prod(feat)) or len(dst.shape) - len(feat) > 3:
            self._check_positions_listed(idx_n, dst)
            self._unsupported(node, f"slot write of {list(src.shape)} at {list(idx.shape)} slots into "
                                    f"{list(val_of(node.args[0]).shape)}: expected src [T, D] (or [T]) and slots [T] "
                                    f"along dim 0")
        if not feat:  # one value per slot: as [T, 1] into [*lead, 1]
            dst = View(dst.buffer, dst.shape + (1,), dst.strides + (1,), dst.offset, dst.pos_stride)
            src = View(src.buffer, src.shape + (1,), src.strides + (1,), src.offset, src.pos_stride)
        # a row of D that spans several of the cache's inner dims ([pages, page, H, Dh] written as
        # [rows, H * Dh]): column tiles must be whole multiples of the dims after the first of them
        inner, align = self.buffers[dst.buffer].shape, 1
        k, span = len(inner), 1
        while k > 0 and span < dst.shape[-1]:
            k -= 1
            span *= inner[k]
        if span == dst.shape[-1] and k < len(inner) - 1:
            align = math.prod(inner[k + 1:])
        elif span != dst.shape[-1]:  # a row that is no whole number of inner rows (1.5 heads): whole rows only
            align = dst.shape[-1]
        attrs = (("col_align", align),) if align > 1 else ()
        self.ops.append(Op(self._name(f"paged_cache_write_{node.name}"), "paged_cache_write", (src, idx), (dst,), attrs,
                           self._prov(node)))
        self.state_writes.add(dst.buffer)
        return self.view_of(node.args[0])

    def _paged_gather(self, n):
        """``cache[block_tables].flatten(1, 2)`` ([pages, page, ...] -> [R, P * page, ...]) -> (cache, block tables)."""
        if not (is_call(n, *RESHAPES) and is_call(n.args[0], aten.index.Tensor)):
            return None
        idx = n.args[0]
        if len(idx.args[1]) != 1 or idx.args[1][0] is None:
            return None
        cache, bt = idx.args[0], idx.args[1][0]
        cv, bv, nv = val_of(cache), val_of(bt), val_of(n)
        if bv.dim() != 2 or cv.dim() < 2 or tuple(nv.shape) != (bv.shape[0], bv.shape[1] * cv.shape[1],
                                                                 *cv.shape[2:]):
            return None
        return cache, bt

    def _position_mask(self, mask, kv: int):
        """``arange(KV) > positions[..., None]`` (positions after each token's own) -> positions node."""
        if is_call(mask, aten.gt.Tensor):
            ar, pu = mask.args
        elif is_call(mask, aten.lt.Tensor):
            pu, ar = mask.args
        else:
            return None
        if not (is_call(pu, aten.unsqueeze.default) and pu.args[1] in (-1, len(val_of(pu).shape) - 1)):
            return None
        val = self.value(ar) if isinstance(ar, fx.Node) and self.cls[ar] == "static" else None
        if not (isinstance(val, Static) and torch.equal(val.value.flatten(), torch.arange(kv, dtype=val.value.dtype))):
            return None
        return pu.args[0]

    def _paged_index_score(self, node: fx.Node):
        """DSA's lightning-indexer score over paged keys (``paged_index_score`` of the example):
        ``masked_fill(squeeze(matmul(w[..., None, :], relu(matmul(q, k^T) (* scale))) (* k_scale),
        arange(KV) > pos, -inf)`` with k (and k_scale) gathered through block tables -> ``index_score``."""
        if not (is_call(node, aten.masked_fill.Scalar) and node.args[2] == float("-inf")):
            return None
        x, kv = node.args[0], val_of(node).shape[-1]
        pos = self._position_mask(node.args[1], kv)
        if pos is None:
            return None
        kscale = None
        if is_call(x, aten.mul.Tensor):  # * k_scale[block_tables].flatten(1, 2).unsqueeze(1): an FP8 key cache
            for y, ku in (x.args, x.args[::-1]):
                if is_call(ku, aten.unsqueeze.default) and ku.args[1] == 1 and is_call(y, aten.squeeze.dim):
                    kscale = self._paged_gather(self._upcast_src(ku.args[0]))
                    if kscale is not None:
                        x = y
                        break
            if kscale is None:
                return None
        if not (is_call(x, aten.squeeze.dim) and x.args[1] in (-2, len(val_of(x).shape) - 1) and is_call(x.args[0],
                                                                                             aten.matmul.default)):
            return None
        wu, rl = x.args[0].args
        if not (is_call(wu, aten.unsqueeze.default) and wu.args[1] in (-2, len(val_of(wu).shape) - 2)
                and is_call(rl, aten.relu.default)):
            return None
        w, z, scale = self._upcast_src(wu.args[0]), rl.args[0], 1.0
        if is_call(z, aten.mul.Tensor) and not isinstance(z.args[1], fx.Node):
            z, scale = z.args[0], float(z.args[1])
        if not is_call(z, aten.matmul.default):
            return None
        q, kt = self._upcast_src(z.args[0]), z.args[1]
        if not (is_call(kt, aten.transpose.int) and {d % 4 for d in kt.args[1:]} == {2, 3}
                and is_call(kt.args[0], aten.unsqueeze.default) and kt.args[0].args[1] == 1):
            return None
        gathered = self._paged_gather(self._upcast_src(kt.args[0].args[0]))
        if gathered is None or (kscale is not None and kscale[1] is not gathered[1]):
            return None
        cache, bt = gathered
        qs, ws, cs, ps = (tuple(val_of(n).shape) for n in (q, w, cache, pos))
        if len(qs) != 4 or ws != qs[:3] or len(cs) != 3 or cs[2] != qs[3] or ps != qs[:2] \
                or tuple(val_of(bt).shape)[0] != qs[0]:
            self._unsupported(node, f"indexer score with q {list(qs)}, weights {list(ws)}, key cache {list(cs)}, "
                                    f"positions {list(ps)}: expected [R, T, H, D], [R, T, H], [pages, page, D], [R, T]")
        if not is_integer(val_of(pos).dtype):
            self._unsupported(node, f"indexer score masked by {str(val_of(pos).dtype).removeprefix('torch.')} "
                                    f"positions: tilec compares integer positions (eager compares the floats)")
        if kscale is not None and tuple(val_of(kscale[0]).shape) != cs[:2]:
            self._unsupported(node, f"key scales of shape {list(val_of(kscale[0]).shape)} for a key cache "
                                    f"{list(cs)}: expected [pages, page] = {list(cs[:2])}")
        inputs = [self.view_of(q), self.view_of(w), self.view_of(cache)]
        if kscale is not None:
            inputs.append(self.view_of(kscale[0]))
        inputs += [self.view_of(bt), self.view_of(pos)]
        return self._emit(node, "index_score", inputs, out_dtype=torch.float32, attrs=(("scale", scale),))
