import json

import pytest


@pytest.fixture(scope="session")
def base_run(tmp_path_factory):
    """A run directory as `kimik3 train` leaves it (config.json, model.safetensors, tokenizer.json) of the 3-layer,
    width-32 model of tests/train/small_run.py, with a 640-token BPE trained on task conversations."""
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.posttrain.sft import task_conversations
    from kimik3.train.data import Document
    from kimik3.train.tokenizer import train_tokenizer
    from tests.train.small_run import small_config

    run = tmp_path_factory.mktemp("runs") / "small"
    docs = [Document(str(i), json.dumps(c)) for i, c in enumerate(task_conversations("train", 4))]
    tokenizer = train_tokenizer(docs, 640)
    K3ForCausalLM(small_config(), seed=0).save_pretrained(run)
    tokenizer.save(str(run / "tokenizer.json"))
    return run


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these small models' many tiny ops spin-wait and run several times slower with two
    threads on a loaded 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
