#!/usr/bin/env bash
# prints, per kernel of the NVRTC-built cubin, the loads before/after griddepcontrol.wait (ACQBULK)
python3 - <<'PY'
import sys, torch
sys.path.insert(0, ".")
from flatserve.model import cuda_gemv
assert cuda_gemv.prepare(torch.device("cuda"))
maj, mi = torch.cuda.get_device_capability()
open("/tmp/nvrtc.cubin", "wb").write(cuda_gemv._API.cubin(f"sm_{maj}{mi}"))
PY
CUO=$(python3 -c "import triton, os; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))")
$CUO -sass /tmp/nvrtc.cubin > /tmp/nvrtc.sass
for k in q4_gemv_r4_u2 q4_gemv_r2_u2 q4_gemv_r1_u2 q4_mma_rp2_u2 q4_mma_rp2_u4 q4_ks_rt8; do
  awk -v K="$k" '$0 ~ "Function : "K"$" {p=1; next} p&&/Function : /{p=0} p' /tmp/nvrtc.sass > /tmp/k.sass
  a=$(grep -n ACQBULK /tmp/k.sass | head -1 | cut -d: -f1)
  echo "$k: LDG before the wait $(head -n $a /tmp/k.sass | grep -c LDG) (non-constant $(head -n $a /tmp/k.sass | grep LDG | grep -vc CONSTANT)), after $(tail -n +$a /tmp/k.sass | grep -c LDG)"
done
