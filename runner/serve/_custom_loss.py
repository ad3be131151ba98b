"""``create_custom_loss`` and ``forward_backward(loss_fn="custom")`` of the tinker flavour.

A session uploads a traced loss once (``POST /api/v1/create_custom_loss``); the server validates
it into a `runner.serve._graph.Program` before anything is compiled (a bad graph is a 400 naming
the node, and the server keeps serving) and answers, through the future, with its ``loss_id``.
``forward_backward(data, "custom", {"loss_id": id})`` from a client of the same session then runs
it per datum inside the trainer's one forward + backward
(`runner.local.LocalTrainer.forward_backward_logprob_loss`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from aiohttp import web
from tinker import types as tt

from runner._types import Seq
from runner.serve._core import Payload, Server, json_response, parse_model, user_error
from runner.serve._graph import GraphError, Program, batch_inputs, compile_graph

#: ``loss_fn`` of a forward_backward that runs an uploaded loss.
CUSTOM = "custom"
#: Validated programs by the digest of their request, so that sessions uploading the same loss
#: (a resumed run, a second client) share its compiled functions; bounded, oldest out first.
_PROGRAMS: collections.OrderedDict[str, Program] = collections.OrderedDict()
_MAX_PROGRAMS = 64


def _program(name: Any, inputs: list, graph: Any, max_nodes: int) -> Program:
    body = {"name": name, "inputs": [i.model_dump() for i in inputs], "graph": graph.model_dump()}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    program = _PROGRAMS.get(digest)
    if program is None:
        program = compile_graph(name, inputs, graph, max_nodes=max_nodes)
        _PROGRAMS[digest] = program
        while len(_PROGRAMS) > _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    return program


async def create_custom_loss(server: Server, request: web.Request) -> web.Response:
    body = await server.json(request)
    req, _ = parse_model(tt.CreateCustomLossRequest, body, what="create_custom_loss")
    session = server.session(req.session_id)
    key = ("create_custom_loss", session.session_id, req.custom_loss_seq_id)
    if key in server.dedup:  # a resubmission
        fut = server.dedup[key]
        return json_response({"request_id": fut.request_id})
    try:
        program = _program(req.name, list(req.inputs), req.graph, server.config.max_loss_nodes)
    except GraphError as exc:
        raise user_error(f"create_custom_loss {req.name!r}: {exc}") from None
    loss_id = f"loss-{uuid.uuid4().hex[:16]}"
    server.custom_losses[loss_id] = (session.session_id, program)
    fut = server.futures.create("CreateCustomLoss")
    server.dedup[key] = fut
    fut.complete(Payload(json={"loss_id": loss_id, "type": "create_custom_loss"}))
    return json_response({"request_id": fut.request_id})


def program_for(server: Server, session_id: str, config: Mapping[str, Any]) -> Program:
    """The uploaded loss a ``custom`` forward_backward names (a user error otherwise)."""
    loss_id = config.get("loss_id")
    entry = server.custom_losses.get(loss_id) if isinstance(loss_id, str) else None
    if entry is None:
        raise user_error(
            f"forward_backward: loss_fn 'custom' needs loss_fn_config loss_id of a loss this "
            f"server created (create_custom_loss), got {loss_id!r}"
        )
    owner, program = entry
    if owner != session_id:
        raise user_error(f"forward_backward: loss {loss_id} belongs to another session")
    if program.inputs[0][1] != 1:
        raise user_error(
            f"forward_backward: loss {program.name!r} takes logprobs of rank 2; this server "
            "computes target logprobs [T] only"
        )
    return program


def run_custom(model: Any, seqs: Sequence[Seq], program: Program):
    """``(logprobs, metrics)`` of one server pass of ``program`` over ``seqs``."""
    for i, seq in enumerate(seqs):
        extra = sorted(set(seq.inputs) - set(program.input_names))
        if extra:
            raise ValueError(
                f"datum {i}: loss_fn_inputs[{extra[0]!r}] is not read by loss {program.name!r}"
            )
    stripped = [Seq(s.tokens, {}) for s in seqs]  # the loss's data travels separately

    def build(rows: int, width: int) -> dict:
        return batch_inputs(program, seqs, rows, width)

    result = model.trainer.forward_backward_logprob_loss(stripped, program.loss_and_grad, build)
    return [np.asarray(lp) for lp in result.logprobs], dict(result.metrics)
