"""A tiny bigram "trainer" for fast runner unit tests (the real one is runner.local).

logprob(x_{t+1} | x_t) = log_softmax(W[x_t])[x_{t+1}]; builtin kernels delegate to `losses`
terms with reduction="token_sum", like every real backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import losses
from runner import AdamParams, ForwardBackwardResult, validate_seqs
from runner._kernels import DOCUMENTED_KERNELS, KERNELS

#: The documented (Tinker) kernels, as the kernel table's terms (config validated by the table).
_KERNELS = {name: KERNELS[name].term for name in DOCUMENTED_KERNELS}


class BigramTrainer:
    builtin_losses = tuple(_KERNELS)

    def __init__(self, vocab: int = 8, seed: int = 0, dtype=jnp.float64):
        self.vocab = vocab
        self.params = jax.random.normal(jax.random.PRNGKey(seed), (vocab, vocab), dtype) * 0.5
        self.grad = None
        self.calls: list[tuple] = []
        self._jitted = {}
        self.counters = {"forward": 0, "backward": 0, "optim_step": 0}

    @staticmethod
    def token_logprobs(params, tokens):
        logp = jax.nn.log_softmax(params[tokens[:-1]], axis=-1)
        return jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]

    def forward(self, seqs):
        validate_seqs(seqs, vocab_size=self.vocab)
        self.calls.append(("forward", len(seqs), tuple(sorted(seqs[0].inputs))))
        self.counters["forward"] += 1
        return [np.asarray(self.token_logprobs(self.params, jnp.asarray(s.tokens))) for s in seqs]

    def forward_backward(self, seqs, loss_name, config=None):
        validate_seqs(seqs, vocab_size=self.vocab)
        if loss_name not in _KERNELS:
            raise ValueError(f"unknown loss {loss_name!r}")
        self.calls.append(("forward_backward", loss_name, dict(config or {}), len(seqs)))
        self.counters["forward"] += 1
        self.counters["backward"] += 1
        key = (loss_name, tuple(sorted((config or {}).items())))
        if key not in self._jitted:
            term = _KERNELS[loss_name](dict(config or {}))

            def total(params, tokens, valid, fields):
                lp = jax.vmap(lambda t: self.token_logprobs(params, t))(tokens)
                return term(
                    jnp.where(valid > 0, lp, 0.0), losses.Batch(action_mask=valid, **fields)
                )[0]

            self._jitted[key] = jax.jit(jax.value_and_grad(total))
        width = 64
        tokens = np.zeros((len(seqs), width + 1), np.int64)
        valid = np.zeros((len(seqs), width))
        fields = {}
        for i, s in enumerate(seqs):
            tokens[i, : s.tokens.shape[0]] = s.tokens
            valid[i, : s.num_targets] = 1.0
            for name, src in (
                ("weights", "weights"),
                ("advantages", "advantages"),
                ("sampling_logprobs", "logprobs"),
            ):
                if src in s.inputs:
                    fields.setdefault(name, np.zeros((len(seqs), width)))[i, : s.num_targets] = (
                        s.inputs[src]
                    )
        value, grad = self._jitted[key](self.params, tokens, valid, fields)
        self.grad = grad if self.grad is None else self.grad + grad
        lps = [np.asarray(self.token_logprobs(self.params, jnp.asarray(s.tokens))) for s in seqs]
        return ForwardBackwardResult(logprobs=lps, metrics={"loss:sum": float(value)})

    def optim_step(self, adam: AdamParams, normalization=None):
        self.calls.append(("optim_step", normalization))
        self.counters["optim_step"] += 1
        self.params = self.params - adam.learning_rate * self.grad
        self.grad = None
        return {"grad_norm": 0.0}
