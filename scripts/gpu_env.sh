# Sourced by every scripts/gpu_*.sh, from the repository root: the carried wheels (.whl/: fla-core,
# and whatever else the device image lacks) go to /tmp/site once per machine (a second script on
# the same warm machine reuses them), and PYTHONPATH puts them and this checkout first.
if [ -d .whl ] && [ ! -f /tmp/site/.k3-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.k3-installed
fi
export PYTHONPATH=/tmp/site:$PWD
