"""A small decoder-only transformer (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP) in float32 on the CPU, with a paged KV cache laid out
as vLLM lays it out: per layer one K and one V tensor of shape
(num_blocks, BLOCK, kv_heads, head_dim); a sequence's tokens live in the
blocks its block table names, token p in block table[p // BLOCK], row p % BLOCK.

The same two functions serve every path (one process, prefill process, decode
process), so the math is the same by construction:
  prefill(tokens, table, cache, on_layer)   writes K/V of every token, no logits
  decode_step(tokens, positions, tables, cache) -> next tokens (greedy)
The prefill covers a prompt's first n-1 tokens; the decoder's first step runs
the last prompt token (as vLLM recomputes it) and yields the first new token.
"""
import math

import torch

BLOCK = 16

FULL = dict(layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, inter=512,
            vocab=1000, max_pos=2048, seed=1234)
SMALL = dict(FULL, layers=2, hidden=128, heads=4, kv_heads=2, inter=256, vocab=500)


class Model:
    def __init__(self, cfg):
        self.cfg = c = dict(cfg)
        self.L, self.H, self.KVH, self.D = c["layers"], c["heads"], c["kv_heads"], c["head_dim"]
        assert self.H % self.KVH == 0
        g = torch.Generator().manual_seed(c["seed"])

        def lin(i, o):  # (in, out), scaled so activations stay O(1)
            return torch.randn(i, o, generator=g, dtype=torch.float32) / math.sqrt(i)

        hid, qd, kvd = c["hidden"], self.H * self.D, self.KVH * self.D
        self.embed = torch.randn(c["vocab"], hid, generator=g, dtype=torch.float32)
        self.layers = []
        for _ in range(self.L):
            self.layers.append(dict(
                attn_norm=1 + 0.1 * torch.randn(hid, generator=g),
                wq=lin(hid, qd), wk=lin(hid, kvd), wv=lin(hid, kvd), wo=lin(qd, hid),
                mlp_norm=1 + 0.1 * torch.randn(hid, generator=g),
                wg=lin(hid, c["inter"]), wu=lin(hid, c["inter"]), wd=lin(c["inter"], hid)))
        self.final_norm = 1 + 0.1 * torch.randn(hid, generator=g)
        self.lm_head = lin(hid, c["vocab"])
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.D, 2, dtype=torch.float32) / self.D))
        ang = torch.outer(torch.arange(c["max_pos"], dtype=torch.float32), inv)
        self.cos, self.sin = torch.cos(ang), torch.sin(ang)   # (max_pos, D/2)
        self.mask = torch.full((c["max_pos"], c["max_pos"]), float("-inf")).triu(1)

    # -- the paged cache
    def new_cache(self, num_blocks, fill=0.0):
        """[K0, V0, K1, V1, ...], each (num_blocks, BLOCK, kv_heads, head_dim)."""
        return [torch.full((num_blocks, BLOCK, self.KVH, self.D), fill, dtype=torch.float32)
                for _ in range(2 * self.L)]

    def new_paged(self, num_blocks, block, heads, order="NHD", fill=0.0):
        """A paged cache of another block size, head count or order (the
        tensor-parallel mode): (tensors as laid out in memory, NHD views of
        them for the model). "HND" tensors are (num_blocks, heads, block,
        head_dim); their views are permuted, so the model writes and reads
        through them unchanged."""
        shape = (num_blocks, block, heads, self.D) if order == "NHD" else \
            (num_blocks, heads, block, self.D)
        ts = [torch.full(shape, fill, dtype=torch.float32) for _ in range(2 * self.L)]
        views = ts if order == "NHD" else [t.permute(0, 2, 1, 3) for t in ts]
        return ts, views

    @staticmethod
    def _write(kc, vc, table, pos, k, v):
        B = kc.shape[1]                  # a cache's own block size
        t = torch.as_tensor(table, dtype=torch.long)
        blk, row = t[pos // B], pos % B
        kc[blk, row] = k
        vc[blk, row] = v

    @staticmethod
    def _gather(c, table, n):
        """The first n tokens of a sequence, read through its block table."""
        B = c.shape[1]
        nb = (n + B - 1) // B
        t = torch.as_tensor(table[:nb], dtype=torch.long)
        return c[t].reshape(nb * B, c.shape[2], c.shape[3])[:n]

    # -- pieces
    @staticmethod
    def _rms(x, w, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def _rope(self, x, pos):  # x (n, heads, D), pos (n,)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        x1, x2 = x[..., : self.D // 2], x[..., self.D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _qkv(self, w, x, pos):
        n = x.shape[0]
        h = self._rms(x, w["attn_norm"])
        q = self._rope((h @ w["wq"]).view(n, self.H, self.D), pos)
        k = self._rope((h @ w["wk"]).view(n, self.KVH, self.D), pos)
        v = (h @ w["wv"]).view(n, self.KVH, self.D)
        return q, k, v

    def _attend(self, q, k, v, causal, chunk=128):  # q (n,H,D), k/v (m,KVH,D) -> (n,H,D)
        """Query head h reads KV head h // (H / KVH) (grouped-query attention).
        Causal: query i (of n) is position m - n + i. Queries go in chunks so
        the scores stay small (large fresh tensors cost page faults)."""
        n, m, rep = q.shape[0], k.shape[0], self.H // self.KVH
        q = (q * (1.0 / math.sqrt(self.D))).view(n, self.KVH, rep, self.D).permute(1, 2, 0, 3)
        kt, vv = k.permute(1, 2, 0).unsqueeze(1), v.permute(1, 0, 2).unsqueeze(1)
        outs = []
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            end = m - n + b if causal else m            # keys beyond end are all masked
            s = torch.matmul(q[:, :, a:b], kt[..., :end])  # (KVH, rep, b-a, end)
            if causal:
                s.add_(self.mask[m - n + a:m - n + b, :end])
            outs.append(torch.matmul(torch.softmax(s, dim=-1), vv[:, :, :end]))
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (KVH, rep, n, D)
        return o.permute(2, 0, 1, 3).reshape(n, self.H, self.D)

    def _rest(self, w, x, attn):  # output projection, residual, SwiGLU MLP
        x = x + attn.reshape(x.shape[0], self.H * self.D) @ w["wo"]
        h = self._rms(x, w["mlp_norm"])
        return x + (torch.nn.functional.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"]

    # -- the two entry points
    @torch.no_grad()
    def prefill(self, tokens, table, cache, on_layer=None, heads=None):
        """K/V of tokens (positions 0..n-1) into cache through table;
        on_layer(l) once layer l's K and V are in the cache. heads=(a, b):
        the cache holds KV heads [a, b) only (a tensor-parallel rank's)."""
        pos = torch.arange(len(tokens))
        x = self.embed[torch.as_tensor(tokens, dtype=torch.long)]
        for l, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, pos)
            if heads is None:
                self._write(cache[2 * l], cache[2 * l + 1], table, pos, k, v)
            else:
                self._write(cache[2 * l], cache[2 * l + 1], table, pos,
                            k[:, heads[0]:heads[1]], v[:, heads[0]:heads[1]])
            if on_layer is not None:
                on_layer(l)
            x = self._rest(w, x, self._attend(q, k, v, causal=True))

    @torch.no_grad()
    def decode_step(self, tokens, positions, tables, cache):
        """One token per sequence at positions; attention over the paged
        cache through each sequence's table. Returns the greedy next tokens."""
        pos = torch.as_tensor(positions, dtype=torch.long)
        x = self.embed[torch.as_tensor(tokens, dtype=torch.long)]
        for l, w in enumerate(self.layers):
            kc, vc = cache[2 * l], cache[2 * l + 1]
            q, k, v = self._qkv(w, x, pos)
            outs = []
            for b, table in enumerate(tables):
                p = int(pos[b])
                self._write(kc, vc, table, pos[b:b + 1], k[b:b + 1], v[b:b + 1])
                outs.append(self._attend(q[b:b + 1], self._gather(kc, table, p + 1),
                                         self._gather(vc, table, p + 1), causal=False))
            x = self._rest(w, x, torch.cat(outs))
        logits = self._rms(x, self.final_norm) @ self.lm_head
        return logits.argmax(-1).tolist()


def prompts(cfg, lengths):
    """Deterministic prompts (token ids) of the given lengths."""
    out = []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(cfg["seed"] * 7919 + i)
        out.append(torch.randint(cfg["vocab"], (n,), generator=g).tolist())
    return out


def blocks_for(ntokens, block=BLOCK):
    return (ntokens + block - 1) // block
