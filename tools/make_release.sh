#!/usr/bin/env bash
# Packs built binaries into a release tarball for machines without Bazel:
#   tools/make_release.sh OUT_DIR OPTIMD_BINARY OPTIMCTL_BINARY
# (tools/release.sh builds them first). The tarball, OUT_DIR/optimd-<version>.tar.gz,
# holds one directory:
#   bin/optimd, bin/optimctl   wrappers that run libexec/ with lib/
#   libexec/                   the binaries
#   lib/                       every shared library they need except the C
#                              library's and the CUDA driver's (these come
#                              from the machine)
#   python/optimd-*.whl        the Python client, gRPC stubs included (pip
#                              install needs no compiler)
#   deploy/                    systemd unit and container recipe
#   install.sh                 copies it all under a prefix (default /usr/local),
#                              the unit to PREFIX/lib/systemd/system
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
optimd_bin=$2
optimctl_bin=$3
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$root/client/python/optimd/client.py")
name="optimd-$version"
stage=$(mktemp -d /tmp/optimd-release.XXXXXX)
trap 'rm -rf "$stage"' EXIT
dir="$stage/$name"
mkdir -p "$dir/bin" "$dir/libexec" "$dir/lib" "$dir/python" "$dir/deploy"
install -m 0755 "$optimd_bin" "$dir/libexec/optimd"
install -m 0755 "$optimctl_bin" "$dir/libexec/optimctl"
# Libraries: what ldd resolves, less glibc's and the GPU driver's.
for b in "$dir/libexec/optimd" "$dir/libexec/optimctl"; do
  ldd "$b" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libnvidia*) ;;
    *) cp -L "$lib" "$dir/lib/" ;;
  esac
done
for tool in optimd optimctl; do
  cat > "$dir/bin/$tool" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/../libexec/$tool" "\$@"
WRAP
  chmod 0755 "$dir/bin/$tool"
done
# The wheel: setup.py generates the stubs here, from the proto tree.
src="$stage/src"
mkdir -p "$src/client" "$src/proto/optimd/v1"
cp -rL "$root/client/python" "$src/client/python"
rm -rf "$src/client/python/build" "$src/client/python/"*.egg-info
cp -L "$root/proto/optimd/v1/optimd.proto" "$src/proto/optimd/v1/"
/usr/bin/python3 -m pip wheel --quiet --no-deps --no-build-isolation \
  --no-index -w "$dir/python" "$src/client/python"
cp "$root/deploy/"* "$dir/deploy/"
cat > "$dir/install.sh" <<'INSTALL'
#!/bin/sh
# install.sh [PREFIX]: copies optimd under PREFIX (default /usr/local):
# PREFIX/lib/optimd/{libexec,lib}, wrappers in PREFIX/bin, and the systemd
# unit, its ExecStart at PREFIX/bin/optimd, as
# PREFIX/lib/systemd/system/optimd@.service (for /usr/local, a directory
# systemd reads units from). Then, for the Python client: pip install
# python/optimd-*.whl
set -eu
prefix=${1:-/usr/local}
here=$(dirname "$(readlink -f "$0")")
mkdir -p "$prefix/bin" "$prefix/lib/optimd" "$prefix/lib/systemd/system"
cp -r "$here/libexec" "$here/lib" "$here/bin" "$prefix/lib/optimd/"
for tool in optimd optimctl; do
  ln -sf "$prefix/lib/optimd/bin/$tool" "$prefix/bin/$tool"
done
unit="$prefix/lib/systemd/system/optimd@.service"
sed "s|/usr/local/bin/optimd|$prefix/bin/optimd|" \
  "$here/deploy/optimd@.service" >"$unit"
chmod 0644 "$unit"
echo "installed optimd under $prefix; the Python client: pip install $here/python/*.whl"
if [ "$prefix" = /usr/local ]; then
  echo "the service: systemctl daemon-reload; systemctl enable --now optimd@USER"
else
  echo "the service: copy $unit to /etc/systemd/system, then systemctl daemon-reload; systemctl enable --now optimd@USER"
fi
INSTALL
chmod 0755 "$dir/install.sh"
tar -czf "$out/$name.tar.gz" -C "$stage" "$name"
echo "$out/$name.tar.gz"
