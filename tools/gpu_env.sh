# Sourced on the GPU machine from the repository root (by tools/gpu_test.sh
# and the .gpu/compare.sh of tools/gpu_compare_builds.sh): unpacks the
# bundle of tools/gpu_bundle.sh if still packed, and sets the environment
# its binaries and the Python client run in.
#
# tools/gpu_bundle.sh packs the bundle into one archive (the device
# machine takes the tree and .gpu together up to 64 MiB).
if [ -f .gpu/bundle.tar.xz ]; then
  tar -xJf .gpu/bundle.tar.xz -C .gpu && rm .gpu/bundle.tar.xz
fi
# torch's NCCL (the bundle has none of its own).
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH=.gpu/lib${nccl_lib:+:$nccl_lib} OPTIMD_BINARY=.gpu/optimd
export OPTIMD_STEP_CHANNEL_LIB=$PWD/.gpu/liboptimd_step_channel.so
export PYTHONPATH=client/python
