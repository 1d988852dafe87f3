"""The card-wide guard on the lent GPU: the ledger's sum against nvidia-smi's device-wide
used memory, for one guarded process holding 4 GiB (what the context allowance stands for).

    OLDGPU_GUARD=pascal PYTHONPATH=src/oldgpu/guard_site:src python3 bench/card_probe.py
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from oldgpu.guard import card

x = torch.empty(4 * 1024**3, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
time.sleep(0.5)  # the watcher publishes
key = str(torch.cuda.get_device_properties(0).uuid)
ledger = card.CardLedger(card.ledger_root() or Path("/nonexistent"), key, 23040)
apps = subprocess.run(
    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
    capture_output=True,
    text=True,
    check=False,
).stdout
mine = [
    int(line.split(",")[1])
    for line in apps.splitlines()
    if line.split(",")[0].strip() == str(os.getpid())
]
entry = [e for e in ledger.entries() if e.pid == os.getpid()]
json.dump(
    {
        "torch": torch.__version__,
        "reserved_mib": torch.cuda.memory_reserved() / 2**20,
        "nvidia_smi_process_mib": mine,
        "nvidia_smi_apps": apps.strip().splitlines(),
        "ledger_entry_mib": [e.total_mib for e in entry],
        "context_measured_mib": (mine[0] - torch.cuda.memory_reserved() / 2**20) if mine else None,
    },
    sys.stdout,
)
print()
