"""The Fireworks control plane of the local server: what ``FireworksTrainer`` and the SDK's
managed path (``FiretitanServiceClient.from_firetitan_config``) call besides training.

One account (``GET /v1/accounts``), validated training shapes (any id resolves to one version
whose deployment shape is local), trainer jobs (``rlorTrainerJobs``: create, get, list,
``:resume``, delete, and the checkpoint listing that outlives the job), hot-load deployments
(create, get, patch, delete; ``/hot_load/v1/models/hot_load`` loads a sampler snapshot of the
deployment's trainer job, synchronously, so the SDK's first status poll sees it ready), and
checkpoint promotion (``:promote``, answered synchronously with the model). Shapes follow
docs/wire.md#endpoints-and-encodings; errors are ``{"error", "category"}`` with a 4xx status (the
SDK's ``parse_api_error`` reads the message).

**Checkpoint namespaces** (`Namespace`): a trainer job's checkpoints (every model trained on the
job; the job record under ``<state_dir>/fireworks/jobs/<job>.json`` keeps them across server
restarts), or, for a client that is not on a trainer's gateway prefix, its session's (in
memory). A name is unique in its namespace; each save adds a row (`ROW_TYPES`).

What is not implemented (a user error says so): serverless training sessions and their
checkpoints, sampling routes, training-shape listing, deployment shapes as resources, and
long-running operations (promotion completes before its reply).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from runner._atomic import atomic_write_json, make_dirs
from runner.serve._core import ServeError, Server, json_response, user_error
from runner.serve._engine import CheckpointRef

log = logging.getLogger("runner.serve")

#: A checkpoint name: the SDK's DNS label (``_validate_checkpoint_ref``).
LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
#: Sampler ``checkpoint_type`` → (control-plane ``checkpointType``, promotable).
SAMPLER_TYPES: dict[str, tuple[str, bool]] = {
    "base": ("CHECKPOINT_TYPE_INFERENCE_BASE", True),
    "delta": ("CHECKPOINT_TYPE_INFERENCE_ARC_V2", False),
}
ROW_TYPES = ("CHECKPOINT_TYPE_TRAINING", *(t for t, _ in SAMPLER_TYPES.values()))
RESUMABLE_STATES = (
    "JOB_STATE_FAILED",
    "JOB_STATE_CANCELLED",
    "JOB_STATE_PAUSED",
    "JOB_STATE_COMPLETED",
)
_CROSS_JOB = "cross_job://"
_PAGE_MAX = 1000


def _now() -> str:
    return (
        datetime.datetime.now(datetime.UTC)
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z")
    )


def check_label(value: Any, what: str) -> str:
    """A checkpoint name (the SDK's DNS-label rule; a user error naming ``what`` otherwise)."""
    if not isinstance(value, str) or not LABEL_RE.match(value):
        raise user_error(
            f"{what} {value!r} must be a DNS label (lower-case letters, digits and '-', at most "
            "63 characters, alphanumeric at both ends)"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Where a model's checkpoint names live: its trainer job, else its session."""

    job: str | None
    session: str

    @property
    def key(self) -> str:
        return f"job:{self.job}" if self.job is not None else f"session:{self.session}"


def resolve_ref(control: ControlPlane, ns: Namespace, path: Any) -> CheckpointRef:
    """A ``load_state`` reference as a checkpoint (a user error naming the rule otherwise).

    ``<name>``: in the model's namespace; ``cross_job://<job>/<name>``: in that job's.
    """
    if not isinstance(path, str) or not path.strip():
        raise user_error("load_weights: path is required")
    path = path.strip()
    if path.startswith(_CROSS_JOB):
        job, sep, name = path[len(_CROSS_JOB) :].partition("/")
        if not sep or not LABEL_RE.match(job) or not LABEL_RE.match(name):
            raise user_error(
                f"load_weights: invalid cross-job reference {path!r} (expected "
                "cross_job://<job>/<name>)"
            )
        control.job(job)  # an unknown job: 404
        entry = control.checkpoint(Namespace(job, ""), name)
        if entry is None:
            raise user_error(f"load_weights: trainer job {job} has no checkpoint {name!r}", 404)
        return entry
    if "/" in path:
        raise user_error(
            f"load_weights: {path!r}: only bare checkpoint names and cross_job:// references are "
            "served here (no serverless <account>/run-<id>/<name> references)"
        )
    check_label(path, "load_weights: path")
    entry = control.checkpoint(ns, path)
    if entry is None:
        where = f"trainer job {ns.job}" if ns.job is not None else "this session"
        raise user_error(f"load_weights: {where} has no checkpoint {path!r}", 404)
    return entry


class ControlPlane:
    """Trainer jobs, checkpoint namespaces, deployments and promoted models (thread-safe).

    Args:
      state_dir: the server's state directory; records live under ``<state_dir>/fireworks``.
      account: the account id every path must name.
    """

    def __init__(self, state_dir: str | Path, account: str) -> None:
        if not LABEL_RE.match(account):
            raise ValueError(f"account {account!r} must be a DNS label")
        self.account = account
        self.root = Path(state_dir) / "fireworks"
        self._lock = threading.RLock()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.models: dict[str, dict[str, Any]] = {}
        self._session_rows: dict[str, list[dict[str, Any]]] = {}
        self._reserved: set[tuple[str, str]] = set()
        #: deployment id → {"identity", "sampler_id", "stage"} of its hot-loaded snapshot.
        self.hot: dict[str, dict[str, Any]] = {}
        self._load()
        self.routes = {
            "fw_accounts": ("GET", "/v1/accounts"),
            "fw_account": ("GET", "/v1/accounts/{acct}"),
            "fw_shape_versions": ("GET", "/v1/accounts/{acct}/trainingShapes/{shape}/versions"),
            "fw_shape_version": (
                "GET",
                "/v1/accounts/{acct}/trainingShapes/{shape}/versions/{version}",
            ),
            "fw_create_job": ("POST", "/v1/accounts/{acct}/rlorTrainerJobs"),
            "fw_list_jobs": ("GET", "/v1/accounts/{acct}/rlorTrainerJobs"),
            "fw_resume_job": ("POST", "/v1/accounts/{acct}/rlorTrainerJobs/{trainer_job}:resume"),
            "fw_get_job": ("GET", "/v1/accounts/{acct}/rlorTrainerJobs/{trainer_job}"),
            "fw_delete_job": ("DELETE", "/v1/accounts/{acct}/rlorTrainerJobs/{trainer_job}"),
            "fw_job_checkpoints": (
                "GET",
                "/v1/accounts/{acct}/rlorTrainerJobs/{trainer_job}/checkpoints",
            ),
            "fw_promote": ("POST", "/v1/accounts/{acct}/checkpoints/{checkpoint}:promote"),
            "fw_get_model": ("GET", "/v1/accounts/{acct}/models/{model}"),
            "fw_create_deployment": ("POST", "/v1/accounts/{acct}/deployments"),
            "fw_get_deployment": ("GET", "/v1/accounts/{acct}/deployments/{deployment}"),
            "fw_patch_deployment": ("PATCH", "/v1/accounts/{acct}/deployments/{deployment}"),
            "fw_delete_deployment": ("DELETE", "/v1/accounts/{acct}/deployments/{deployment}"),
            "fw_hot_load": ("POST", "/hot_load/v1/models/hot_load"),
            "fw_hot_load_status": ("GET", "/hot_load/v1/models/hot_load"),
        }
        self.handlers = {
            "fw_accounts": self.list_accounts,
            "fw_account": self.get_account,
            "fw_shape_versions": self.shape_versions,
            "fw_shape_version": self.shape_version,
            "fw_create_job": self.create_job,
            "fw_list_jobs": self.list_jobs,
            "fw_resume_job": self.resume_job,
            "fw_get_job": self.get_job,
            "fw_delete_job": self.delete_job,
            "fw_job_checkpoints": self.job_checkpoints,
            "fw_promote": self.promote,
            "fw_get_model": self.get_model,
            "fw_create_deployment": self.create_deployment,
            "fw_get_deployment": self.get_deployment,
            "fw_patch_deployment": self.patch_deployment,
            "fw_delete_deployment": self.delete_deployment,
            "fw_hot_load": self.hot_load,
            "fw_hot_load_status": self.hot_load_status,
        }

    # -- persistence --------------------------------------------------------------------------

    def _load(self) -> None:
        for kind, store in (("jobs", self.jobs), ("deployments", self.deployments)):
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for path in sorted(folder.glob("*.json")):
                try:
                    record = json.loads(path.read_text())
                except (OSError, ValueError) as exc:
                    log.warning("skipping unreadable %s record %s: %s", kind, path, exc)
                    continue
                store[path.stem] = record
        folder = self.root / "models"
        if folder.is_dir():
            for path in sorted(folder.glob("*.json")):
                try:
                    self.models[path.stem] = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue

    def _save(self, kind: str, key: str, record: Mapping[str, Any]) -> None:
        make_dirs(self.root / kind)
        atomic_write_json(self.root / kind / f"{key}.json", record)

    # -- lookups (shared with the training flavour) -------------------------------------------

    def check_account(self, account: Any) -> None:
        if account != self.account:
            raise user_error(
                f"unknown account {account!r} (this server serves {self.account!r})", 404
            )

    def job(self, job_id: Any) -> dict[str, Any]:
        record = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if record is None:
            raise user_error(f"trainer job {job_id!r} was not found in this account", 404)
        return record

    def job_name(self, job_id: str) -> str:
        return f"accounts/{self.account}/rlorTrainerJobs/{job_id}"

    def check_base(self, job_id: str, base_model: str) -> None:
        want = self.job(job_id)["trainingConfig"].get("baseModel")
        if want != base_model:
            raise user_error(
                f"create_model: base_model {base_model!r} differs from trainer job {job_id}'s "
                f"base model {want!r}"
            )

    def add_model(self, job_id: str, model_id: str) -> None:
        with self._lock:
            record = self.job(job_id)
            record.setdefault("_models", []).append(model_id)
            self._save("jobs", job_id, record)

    def _rows(self, ns: Namespace) -> list[dict[str, Any]]:
        if ns.job is not None:
            return self.job(ns.job).setdefault("_checkpoints", [])
        return self._session_rows.setdefault(ns.session, [])

    def checkpoint(self, ns: Namespace, name: str) -> CheckpointRef | None:
        with self._lock:
            for row in self._rows(ns):
                if row["short"] == name:
                    return CheckpointRef(row["model_id"], row["kind"], row["ref_name"])
        return None

    def reserve(self, ns: Namespace, name: str) -> None:
        """Claims a name in its namespace before the save (a user error when it is taken)."""
        with self._lock:
            if (ns.key, name) in self._reserved or any(r["short"] == name for r in self._rows(ns)):
                raise user_error(
                    f"checkpoint {name!r} already exists in "
                    + (f"trainer job {ns.job}" if ns.job else "this session")
                    + " (names are unique; the SDK cannot overwrite)"
                )
            self._reserved.add((ns.key, name))

    def release(self, ns: Namespace, name: str) -> None:
        with self._lock:
            self._reserved.discard((ns.key, name))

    def add_checkpoint(
        self, ns: Namespace, name: str, ref: CheckpointRef, row_type: str, promotable: bool
    ) -> None:
        with self._lock:
            stamp = _now()
            self._rows(ns).append(
                {
                    "short": name,
                    "model_id": ref.model_id,
                    "kind": ref.kind,
                    "ref_name": ref.name,
                    "checkpointType": row_type,
                    "promotable": promotable,
                    "createTime": stamp,
                }
            )
            self._reserved.discard((ns.key, name))
            if ns.job is not None:
                record = self.job(ns.job)
                record["updateTime"] = stamp
                self._save("jobs", ns.job, record)

    def state_names(self, job_id: str) -> list[str]:
        with self._lock:
            return [r["short"] for r in self._rows(Namespace(job_id, "")) if r["kind"] == "state"]

    def sampler_ref(self, job_id: str | None, identity: str) -> CheckpointRef | None:
        """A sampler snapshot by its identity: in ``job_id``, else in any job (unique)."""
        with self._lock:
            jobs = [job_id] if job_id in self.jobs else []
            jobs += [j for j in self.jobs if j != job_id]
            for j in jobs:
                for row in self.jobs[j].get("_checkpoints", []):
                    if row["short"] == identity and row["kind"] == "sampler":
                        return CheckpointRef(row["model_id"], "sampler", row["ref_name"])
            for rows in self._session_rows.values():
                for row in rows:
                    if row["short"] == identity and row["kind"] == "sampler":
                        return CheckpointRef(row["model_id"], "sampler", row["ref_name"])
        return None

    # -- accounts and shapes ------------------------------------------------------------------

    async def list_accounts(self, server: Server, request: web.Request) -> web.Response:
        return json_response({"accounts": [self._account()]})

    async def get_account(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        return json_response(self._account())

    def _account(self) -> dict[str, Any]:
        return {"name": f"accounts/{self.account}", "displayName": "foldloss local server"}

    def _shape_version(self, server: Server, acct: str, shape: str, version: str = "1") -> dict:
        longest = max(b.max_seq_len for b in server.engine.base_models.values())
        return {
            "name": f"accounts/{acct}/trainingShapes/{shape}/versions/{version}",
            "latestValidated": True,
            "snapshot": {
                "trainerImageTag": "foldloss-local",
                "maxSupportedContextLength": longest,
                "nodeCount": 1,
                "deploymentShapeVersion": f"accounts/{acct}/deploymentShapes/{shape}/versions/1",
                "deploymentImageTag": "foldloss-local",
                "acceleratorType": "CPU",
                "acceleratorCount": 1,
                "baseModelWeightPrecision": "float32",
                "trainerShardingScheme": {"pipelineParallelism": 1},
                "trainerMode": "POLICY_TRAINER",
            },
        }

    async def shape_versions(self, server: Server, request: web.Request) -> web.Response:
        m = request.match_info
        return json_response(
            {"trainingShapeVersions": [self._shape_version(server, m["acct"], m["shape"])]}
        )

    async def shape_version(self, server: Server, request: web.Request) -> web.Response:
        m = request.match_info
        return json_response(self._shape_version(server, m["acct"], m["shape"], m["version"]))

    # -- trainer jobs -------------------------------------------------------------------------

    @staticmethod
    def _public(record: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record.items() if not k.startswith("_")}

    async def create_job(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        body = await server.json(request)
        job_id = (
            request.query.get("rlorTrainerJobId") or f"training-api-service-{uuid.uuid4().hex[:8]}"
        )
        check_label(job_id, "rlorTrainerJobId")
        config = body.get("trainingConfig")
        if not isinstance(config, dict):
            raise user_error("rlorTrainerJobs: trainingConfig (an object) is required")
        base = server.engine.base(config.get("baseModel"))
        rank = config.get("loraRank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise user_error(f"rlorTrainerJobs: trainingConfig.loraRank must be >= 0, got {rank!r}")
        context = config.get("maxContextLength")
        if context is not None and (
            isinstance(context, bool) or not isinstance(context, int) or context < 1
        ):
            raise user_error("rlorTrainerJobs: trainingConfig.maxContextLength must be >= 1")
        if body.get("forwardOnly"):
            raise user_error("rlorTrainerJobs: forward-only (reference) trainers are not supported")
        with self._lock:
            if job_id in self.jobs:
                raise user_error(f"trainer job {job_id} already exists", 409)
            stamp = _now()
            record = {
                "name": self.job_name(job_id),
                "state": "JOB_STATE_RUNNING",
                "createTime": stamp,
                "updateTime": stamp,
                "serviceMode": True,
                "displayName": body.get("displayName") or job_id,
                "trainingConfig": {
                    **config,
                    "baseModel": base.name,
                    "loraRank": rank,
                    "maxContextLength": min(context or base.max_seq_len, base.max_seq_len),
                },
                "trainingShape": request.query.get("trainingShape"),
                "statusMessage": (
                    "LoRA is trained as full weights by the local server (the base model has no "
                    "LoRA support)"
                    if rank and not base.supports_lora
                    else ""
                ),
                "_checkpoints": [],
                "_models": [],
            }
            self.jobs[job_id] = record
            self._save("jobs", job_id, record)
        return json_response(self._public(record))

    async def list_jobs(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        return json_response({"rlorTrainerJobs": [self._public(r) for r in self.jobs.values()]})

    async def get_job(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        return json_response(self._public(self.job(request.match_info["trainer_job"])))

    async def resume_job(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        job_id = request.match_info["trainer_job"]
        with self._lock:
            record = self.job(job_id)
            if record["state"] not in (*RESUMABLE_STATES, "JOB_STATE_RUNNING"):
                raise user_error(f"trainer job {job_id} is {record['state']}; it cannot resume")
            record["state"], record["updateTime"] = "JOB_STATE_RUNNING", _now()
            self._save("jobs", job_id, record)
        return json_response(self._public(record))

    async def delete_job(self, server: Server, request: web.Request) -> web.Response:
        """Deletes a trainer: its models stop; its checkpoints stay listable and promotable."""
        self.check_account(request.match_info["acct"])
        job_id = request.match_info["trainer_job"]
        with self._lock:
            record = self.job(job_id)
            record["state"], record["updateTime"] = "JOB_STATE_DELETED", _now()
            self._save("jobs", job_id, record)
            models = list(record.get("_models", []))
        for model_id in models:  # their queues stay: later requests fail in turn, saying why
            server.engine.unload(model_id)
        return json_response({})

    async def job_checkpoints(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        job_id = request.match_info["trainer_job"]
        try:
            size = int(request.query.get("pageSize", "200"))
            start = int(request.query.get("pageToken") or 0)
        except ValueError:
            raise user_error("checkpoints: pageSize and pageToken must be integers") from None
        if not 1 <= size <= _PAGE_MAX or start < 0:
            raise user_error(f"checkpoints: pageSize must be in [1, {_PAGE_MAX}]")
        with self._lock:
            rows = list(self.job(job_id).get("_checkpoints", []))
        page = [
            {
                "name": f"{self.job_name(job_id)}/checkpoints/{r['short']}",
                "createTime": r["createTime"],
                "updateTime": r["createTime"],
                "checkpointType": r["checkpointType"],
                "promotable": r["promotable"],
            }
            for r in rows[start : start + size]
        ]
        reply: dict[str, Any] = {"checkpoints": page}
        if start + size < len(rows):
            reply["nextPageToken"] = str(start + size)
        return json_response(reply)

    # -- promotion ----------------------------------------------------------------------------

    async def promote(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        short = request.match_info["checkpoint"]
        body = await server.json(request)
        unknown = sorted(
            set(body) - {"output_model", "trainer_job_id", "base_model", "async_promotion"}
        )
        if unknown:
            raise user_error(f"promote: unknown fields {unknown}")
        output = body.get("output_model")
        prefix = f"accounts/{self.account}/models/"
        if not isinstance(output, str) or not output.startswith(prefix):
            raise user_error(f"promote: output_model must be {prefix}<id>")
        model_id = output[len(prefix) :]
        if not re.fullmatch(r"[a-z0-9-]{1,63}", model_id):
            raise user_error(f"promote: output model id {model_id!r} must be 1-63 of [a-z0-9-]")
        job_ref = body.get("trainer_job_id")
        jprefix = f"accounts/{self.account}/rlorTrainerJobs/"
        if not isinstance(job_ref, str) or not job_ref.startswith(jprefix):
            raise user_error(f"promote: trainer_job_id must be {jprefix}<job>")
        job_id = job_ref[len(jprefix) :]
        record = self.job(job_id)
        base_model = body.get("base_model")
        if base_model != record["trainingConfig"].get("baseModel"):
            raise user_error(
                f"promote: base_model {base_model!r} is not the trainer's "
                f"{record['trainingConfig'].get('baseModel')!r}"
            )
        with self._lock:
            rows = [r for r in record.get("_checkpoints", []) if r["short"] == short]
            if not rows:
                raise user_error(f"promote: trainer job {job_id} has no checkpoint {short!r}", 404)
            row = rows[0]
            if not row["promotable"]:
                raise user_error(
                    f"promote: checkpoint {short!r} ({row['checkpointType']}) is not promotable "
                    "(only base sampler snapshots are)"
                )
            if model_id in self.models:
                raise user_error(f"promote: model {output} already exists", 409)
        ref = CheckpointRef(row["model_id"], row["kind"], row["ref_name"])
        # The toy's sampler weights are one safetensors file; a decoder's are a transformers
        # directory (config.json + model.safetensors), or a PEFT adapter directory under LoRA:
        # promoted as Fireworks' LoRA add-on kind.
        directory = server.engine.sampler_dir(ref)
        source = directory or server.engine._state_path(ref)
        if directory is not None:
            target = self.root / "models" / model_id
            kind = (
                "HF_PEFT_ADDON" if (source / "adapter_config.json").is_file() else "HF_BASE_MODEL"
            )
        else:
            target = self.root / "models" / f"{model_id}.safetensors"
            kind = "HF_BASE_MODEL"

        def copy() -> None:
            make_dirs(target.parent)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
            if directory is not None:
                shutil.copytree(source, tmp)
            else:
                shutil.copyfile(source, tmp)
            tmp.replace(target)

        try:
            await server.run_blocking(copy)
        except OSError as exc:
            raise ServeError(
                f"promote: cannot copy the weights: {exc}", category="server"
            ) from None
        model = {
            "name": output,
            "state": "READY",
            "kind": kind,
            "baseModel": base_model,
            "checkpoint": f"{self.job_name(job_id)}/checkpoints/{short}",
            "createTime": _now(),
            "weights": str(target),
        }
        with self._lock:
            self.models[model_id] = model
            self._save("models", model_id, model)
        return json_response({"model": model})

    async def get_model(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        model = self.models.get(request.match_info["model"])
        if model is None:
            raise user_error(f"model {request.match_info['model']!r} not found", 404)
        return json_response(model)

    # -- deployments and hot load -------------------------------------------------------------

    def deployment(self, deployment_id: Any) -> dict[str, Any]:
        record = self.deployments.get(deployment_id) if isinstance(deployment_id, str) else None
        if record is None:
            raise user_error(f"deployment {deployment_id!r} not found", 404)
        return record

    def _deployment_job(self, value: Any) -> str | None:
        if value in (None, ""):
            return None
        prefix = f"accounts/{self.account}/rlorTrainerJobs/"
        if not isinstance(value, str) or not value.startswith(prefix):
            raise user_error(f"deployments: hotLoadTrainerJob must be {prefix}<job>")
        job_id = value[len(prefix) :]
        self.job(job_id)
        return value

    async def create_deployment(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        deployment_id = request.query.get("deploymentId")
        check_label(deployment_id, "deploymentId")
        body = await server.json(request)
        base = server.engine.base(body.get("baseModel"))
        job = self._deployment_job(body.get("hotLoadTrainerJob"))
        with self._lock:
            existing = self.deployments.get(deployment_id)
            if existing is not None and existing["state"] != "DELETED":
                raise user_error(f"deployment {deployment_id} already exists", 409)
            record = {
                "name": f"accounts/{self.account}/deployments/{deployment_id}",
                "state": "READY",
                "baseModel": base.name,
                "description": body.get("description", ""),
                "minReplicaCount": body.get("minReplicaCount", 1),
                "maxReplicaCount": body.get("maxReplicaCount", 1),
                "enableHotLoad": bool(body.get("enableHotLoad", True)),
                "hotLoadTrainerJob": job,
                "hotLoadBucketType": body.get("hotLoadBucketType"),
                "deploymentShape": body.get("deploymentShape"),
                "createTime": _now(),
            }
            self.deployments[deployment_id] = record
            self._save("deployments", deployment_id, record)
        return json_response(record)

    async def get_deployment(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        record = self.deployment(request.match_info["deployment"])
        if record["state"] == "DELETED":
            raise user_error(f"deployment {request.match_info['deployment']!r} not found", 404)
        return json_response(record)

    async def patch_deployment(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        deployment_id = request.match_info["deployment"]
        body = await server.json(request)
        allowed = {
            "hotLoadTrainerJob",
            "minReplicaCount",
            "maxReplicaCount",
            "hotLoadTransitionType",
        }
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise user_error(f"deployments: fields {unknown} cannot be updated")
        with self._lock:
            record = self.deployment(deployment_id)
            if "hotLoadTrainerJob" in body:
                record["hotLoadTrainerJob"] = self._deployment_job(body["hotLoadTrainerJob"])
                self.hot.pop(deployment_id, None)
            for key in ("minReplicaCount", "maxReplicaCount", "hotLoadTransitionType"):
                if key in body:
                    record[key] = body[key]
            self._save("deployments", deployment_id, record)
        return json_response(record)

    async def delete_deployment(self, server: Server, request: web.Request) -> web.Response:
        self.check_account(request.match_info["acct"])
        deployment_id = request.match_info["deployment"]
        with self._lock:
            record = self.deployment(deployment_id)
            record["state"] = "DELETED"
            self._save("deployments", deployment_id, record)
            hot = self.hot.pop(deployment_id, None)
        if hot is not None:
            server.engine.samplers.pop(hot["sampler_id"], None)
        return json_response({})

    def _hot_target(self, request: web.Request) -> str:
        value = request.headers.get("fireworks-deployment", "")
        prefix = f"accounts/{self.account}/deployments/"
        if not value.startswith(prefix):
            raise user_error(f"hot_load: header fireworks-deployment must be {prefix}<deployment>")
        deployment_id = value[len(prefix) :]
        record = self.deployment(deployment_id)
        if record["state"] == "DELETED":
            raise user_error(f"deployment {deployment_id!r} not found", 404)
        model = request.headers.get("fireworks-model")
        if model is not None and model != record["baseModel"]:
            raise user_error(
                f"hot_load: fireworks-model {model!r} is not the deployment's base model "
                f"{record['baseModel']!r}"
            )
        return deployment_id

    async def hot_load(self, server: Server, request: web.Request) -> web.Response:
        """Loads a sampler snapshot into the deployment (done when the reply comes)."""
        deployment_id = self._hot_target(request)
        body = await server.json(request)
        unknown = sorted(
            set(body) - {"identity", "reset_prompt_cache", "incremental_snapshot_metadata"}
        )
        if unknown:
            raise user_error(f"hot_load: unknown fields {unknown}")
        identity = body.get("identity")
        if not isinstance(identity, str) or not identity:
            raise user_error("hot_load: identity (the sampler snapshot's path) is required")
        meta = body.get("incremental_snapshot_metadata")
        if meta is not None and not isinstance(meta, dict):
            raise user_error("hot_load: incremental_snapshot_metadata must be an object")
        record = self.deployment(deployment_id)
        job = record.get("hotLoadTrainerJob")
        ref = self.sampler_ref(job.rsplit("/", 1)[-1] if job else None, identity)
        if ref is None:
            raise user_error(
                f"hot_load: no sampler snapshot {identity!r} in the deployment's trainer job", 404
            )
        base, params = await server.run_blocking(server.engine.params_of, ref)
        if base.name != record["baseModel"]:
            raise user_error(
                f"hot_load: snapshot {identity!r} is of base model {base.name!r}, not the "
                f"deployment's {record['baseModel']!r}"
            )
        sampler_id = f"fw:{deployment_id}:{uuid.uuid4().hex[:12]}"
        server.engine.new_sampler(sampler_id, base, params, identity)
        with self._lock:
            old = self.hot.get(deployment_id)
            self.hot[deployment_id] = {
                "identity": identity,
                "sampler_id": sampler_id,
                "previous": old["sampler_id"] if old else None,
                "time": time.time(),
            }
        if old is not None and old.get("previous"):
            # keep the previous snapshot for requests still in flight; drop the one before
            server.engine.samplers.pop(old["previous"], None)
        return json_response({"identity": identity, "status": "loaded"})

    async def hot_load_status(self, server: Server, request: web.Request) -> web.Response:
        deployment_id = self._hot_target(request)
        hot = self.hot.get(deployment_id)
        replica = {
            "current_snapshot_identity": hot["identity"] if hot else None,
            "readiness": True,
            "loading_state": {"stage": "done" if hot else "idle"},
        }
        return json_response({"replicas": [replica]})

    async def sampler_for(self, server: Server, model: Any) -> str:
        """The sampling session of a completions ``model``: a deployment's hot-loaded snapshot
        (its base weights before any hot load) or a served base model's initial weights."""
        prefix = f"accounts/{self.account}/deployments/"
        if isinstance(model, str) and model.startswith(prefix):
            deployment_id = model[len(prefix) :]
            record = self.deployment(deployment_id)
            if record["state"] == "DELETED":
                raise user_error(f"deployment {deployment_id!r} was deleted")
            hot = self.hot.get(deployment_id)
            if hot is not None:
                return hot["sampler_id"]
            return await self._base_sampler(server, record["baseModel"])
        if isinstance(model, str) and model in server.engine.base_models:
            return await self._base_sampler(server, model)
        raise user_error(
            f"completions: unknown model {model!r}; give accounts/{self.account}/deployments/<id> "
            f"or a served base model ({sorted(server.engine.base_models)})"
        )

    async def _base_sampler(self, server: Server, base_name: str) -> str:
        sampler_id = f"fw-base:{base_name}"
        if sampler_id not in server.engine.samplers:
            base = server.engine.base(base_name)
            params = await server.run_blocking(server.engine.base_params, base)
            server.engine.new_sampler(sampler_id, base, params)
        return sampler_id
