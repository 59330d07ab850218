import os
import sys

# Tests never touch the network: the hub client must answer from local files or fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
