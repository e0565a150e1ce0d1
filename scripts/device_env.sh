# Source on the GPU machine (no network) before running dustin there:
#   . scripts/device_env.sh
# - installs the carried wheels (.whl/: gguf, wonderwords, fastapi and its needs, ...) into /tmp/site once per machine;
# - points dustin at /root/dh (models) and the carried data packages (.devdata/, see dustin/data/packages.py);
# - after ../shared/tools/device-weights staged and assembled the GGUFs in /root/models, converts them once
#   (`dustin models fetch` finds the checked GGUFs and only converts).
set -e
if [ ! -f /tmp/site/.dustin-wheels ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.dustin-wheels
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export DUSTIN_HOME=/root/dh PYTHONUNBUFFERED=1
[ -d .devdata ] && export DUSTIN_DATA_DIR="$PWD/.devdata"
mkdir -p /root/dh/gguf
for f in /root/models/*.gguf; do
  [ -e "$f" ] || continue
  [ -e "/root/dh/gguf/$(basename "${f%-q4_k_m.gguf}").gguf" ] || mv "$f" "/root/dh/gguf/$(basename "${f%-q4_k_m.gguf}").gguf"
done
if [ ! -f /root/dh/models/qwen2.5-coder-0.5b-instruct/dustin-source.json ] && ls /root/dh/gguf/*.gguf >/dev/null 2>&1; then
  t0=$(date +%s.%N)
  python3 -m dustin models fetch > /tmp/fetch.log 2>&1 || { tail -5 /tmp/fetch.log; false; }
  grep "ready in" /tmp/fetch.log  # each model's "ready" line: seconds to check its GGUF and to convert it
  echo "== models fetch (convert the pair): $(python3 -c "import time; print(round(time.time() - $t0, 1))") s on $(nproc) cores" \
    "(cgroup CPU quota: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || echo none))"
fi
set +e
