#!/usr/bin/env bash
# SkyRL tx (PyPI skyrl 0.4.0, JAX backend, CPU) on loopback with a random tiny Qwen3 whose
# vocabulary is the character tokenizer's 53 ids, then the runner's SFT and RL against it with
# the tinker SDK it pins (0.25.x). Not run in CI (installs ~1.4 GB, ~2 min). Everything goes
# under $SKYRL_DIR (default /tmp/skyrl). Run from the repository root with the project's venv
# active (it needs torch and transformers only to write the random checkpoint).
# docs/tinker.md "Self-hosted engines" says what it prints and why.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${SKYRL_DIR:-/tmp/skyrl}"
py312="${PYTHON312:-python3.12}"   # skyrl requires Python >=3.12,<3.15
port="${SKYRL_PORT:-8001}"
mkdir -p "$root"

# 1. skyrl in its own venv: its tinker+jax extras by hand, without peft (which pulls a CUDA torch);
#    aiohttp is imported but not declared.
if [ ! -x "$root/venv/bin/python" ]; then
    "$py312" -m venv "$root/venv"
    "$root/venv/bin/pip" install --quiet 'datasets>=4.0.0' 'pillow>=11.3.0' 'rich>=14.1.0' \
        'safetensors>=0.6.2' 'tokenizers>=0.23.1' 'transformers>=5.6.1,<=5.16.1' 'typer>=0.17.4' \
        hf_transfer 'cloudpathlib>=0.23.0' 'zstandard>=0.23.0' 'xxhash>=3.0.0' \
        'tinker>=0.25,<0.26' 'fastapi[standard]' sqlmodel 'sqlalchemy[asyncio]' aiosqlite asyncpg \
        psycopg2-binary 'jax>=0.8,<1.0' 'flax>=0.12.10' 'optax>=0.2.5' aiohttp psutil
    "$root/venv/bin/pip" install --quiet --no-deps 'skyrl==0.4.0'
fi
# The JAX path imports torch (vision inputs only: isinstance checks) and peft (LoraConfig's
# adapter_config.json when saving a LoRA): stand-ins for both, found through a .pth file.
mkdir -p "$root/stubs/torch" "$root/stubs/peft" "$root/bin"
cat > "$root/stubs/torch/__init__.py" <<'PY'
"""Stand-in for torch: skyrl's JAX path uses it only for vision inputs."""
class Tensor:
    pass
def cat(*args, **kwargs):
    raise NotImplementedError("torch stand-in: vision inputs are not supported")
PY
cat > "$root/stubs/peft/__init__.py" <<'PY'
"""Stand-in for peft: skyrl's JAX path uses only LoraConfig(...).save_pretrained(dir)."""
import json, os
class LoraConfig:
    def __init__(self, base_model_name_or_path=None, r=8, lora_alpha=8, **kw):
        self.d = dict(peft_type="LORA", base_model_name_or_path=base_model_name_or_path, r=r,
                      lora_alpha=lora_alpha, **kw)
    def save_pretrained(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            json.dump(self.d, f)
PY
site="$("$root/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$root/stubs" > "$site/skyrl_stubs.pth"
# skyrl.tinker.api relaunches its engine as `uv run <its parent's uv flags> -m skyrl.tinker.engine`
# (it reads its parent's command line): a stand-in uv that runs the venv's python as a child.
cat > "$root/bin/uv" <<SH
#!/usr/bin/env bash
while [ \$# -gt 0 ] && [ "\$1" != "-m" ]; do shift; done
"$root/venv/bin/python" "\$@"
SH
chmod +x "$root/bin/uv"

# 2. The random tiny Qwen3 over the character tokenizer's ids, and a tokenizer.json for its
#    AutoTokenizer.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python - "$root/model" <<'PY'
import json, sys
from pathlib import Path
import torch, transformers
from runner.env import tokenizer as chars
from runner.tokenizers import CharTokenizer
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
tok = CharTokenizer()
cfg = transformers.Qwen3Config(
    vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
    pad_token_id=tok.pad_id)
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
vocab = {tok.decode([i]): i for i in range(len(chars.SPECIALS), tok.vocab_size)}
vocab |= {s: i for i, s in enumerate(chars.SPECIALS)}
assert len(vocab) == tok.vocab_size
(out / "tokenizer.json").write_text(json.dumps({
    "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
    "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}
                     for i, s in enumerate(chars.SPECIALS)],
    "pre_tokenizer": {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated",
                      "invert": False},
    "post_processor": None, "decoder": None,
    "model": {"type": "WordLevel", "vocab": vocab, "unk_token": chars.SPECIALS[tok.pad_id]}}))
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token,
    "bos_token": tok.bos_token, "pad_token": chars.SPECIALS[tok.pad_id]}))
PY

# 3. The engine on loopback (its default host is 0.0.0.0), in its own process group (the API
#    process and the engine it relaunches are stopped together at exit).
(cd "$root" && PATH="$root/bin:$PATH" JAX_PLATFORMS=cpu exec setsid uv run --extra tinker \
    --extra jax -m skyrl.tinker.api --host 127.0.0.1 --port "$port" --base-model "$root/model" \
    --backend jax > "$root/server.log" 2>&1) &
server=$!
trap 'kill -- "-$server" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$port/api/v1/healthz" > /dev/null && break
    sleep 1
done

# 4. The runner with the SDK SkyRL pins, shadowing the venv's copy.
python -m pip install --quiet --no-deps --target "$root/tinker025" 'tinker==0.25.*'
export PYTHONPATH="$root/tinker025:$PWD${PYTHONPATH:+:$PYTHONPATH}" TINKER_TELEMETRY=0
export TINKER_API_KEY="tml-$(python -c 'import secrets; print(secrets.token_hex(16))')"
set_=(--backend tinker --config examples/tiny.toml --output-dir "$root/runs" --no-progress
      --set "tinker.base_url=\"http://127.0.0.1:$port\"" --set "tinker.base_model=\"$root/model\""
      --set tinker.lora_rank=8)
python -m runner sft "${set_[@]}" --name sft || echo "sft: exit $?"
python -m runner train "${set_[@]}" --name rl-client --sft-steps 0 || echo "train (client path): exit $?"
python -m runner train "${set_[@]}" --name rl-builtin --sft-steps 0 --env-coef 0 \
    || echo "train (builtin ppo): exit $?"
