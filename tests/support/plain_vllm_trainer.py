"""A training script written against vLLM's own trainer API, as vLLM documents it, with one change: the
import that registers the gloo backend (and gives its init info). It pushes a Hugging Face model into the
server at URL, a replica or a pool's gateway (the admin key in the URL: HTTP Basic), its world the
server's `/get_world_size` plus the trainer, as vLLM's RLHF examples count it, and prints `{"done": true}`.

    python tests/support/plain_vllm_trainer.py http://trainer:KEY@127.0.0.1:PORT CHECKPOINT_DIR
"""

import json
import sys

import requests
import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

from sampler_client.weight_transfer import GlooTrainerInitInfo  # the one line this project adds

url, checkpoint = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
world_size = 1 + requests.get(f"{url}/get_world_size", timeout=60).json()["world_size"]
engine = WeightTransferTrainerFactory.trainer_init(
    GlooTrainerInitInfo(master_address="127.0.0.1", world_size=world_size, rank=0),
    client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
engine.send_weights()
engine.shutdown()
print(json.dumps({"done": True}))
