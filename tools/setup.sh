#!/usr/bin/env bash
# Installs every Debian package optimd needs to build, test and run its demo.
# Idempotent: packages already present are not reinstalled. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  bazel-bootstrap bazel-rules-java bazel-platforms
  g++ libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev googletest libbenchmark-dev nlohmann-json3-dev
  python3-grpcio python3-protobuf python3-torch python3-numpy
  python3-pip python3-setuptools python3-venv
  openssl
  clang clang-format libspdlog-dev libisal-dev libmicrohttpd-dev
  prometheus-cpp-dev
  python3-prometheus-client
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "setup: missing packages (${missing[*]}) and not root; run as root" >&2
    exit 1
  fi
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup: done"
