"""Under ``accelerate launch``: build a trainer with each bad checkpoint mirror given as JSON (``argv[2]``: a list of
``[case, config fields]``), and write, per rank, the refusal each raised and whether the model was loaded first
(``argv[1]/refusals_rankR.json``). One launch answers every case; each case raises on every rank."""

import functools
import json
import os
import sys

import launched  # tests/scripts/, beside this file
from datasets import Dataset

import trl_ext
from trl_ext.assets import default_model_path
from trl_ext.errors import MirrorError
from trl_ext.process.ranks import env_rank

if __name__ == "__main__":
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    loaded, found = [], {}
    original = trl_ext.SFTTrainer._trl_class.__init__

    @functools.wraps(original)  # the trainer binds its arguments by TRL's signature
    def recording_init(self, *args, **kwargs):
        loaded.append(True)
        return original(self, *args, **kwargs)

    trl_ext.SFTTrainer._trl_class.__init__ = recording_init
    rows = Dataset.from_list([{"text": "1+1=2"}] * 4)
    for case, fields in cases:
        args = trl_ext.SFTConfig(output_dir=os.path.join(out, case), max_steps=1, report_to="none", **fields)
        try:
            trl_ext.SFTTrainer(model=default_model_path(), args=args, train_dataset=rows)
            found[case] = None
        except MirrorError as exc:
            found[case] = str(exc)
    with open(os.path.join(out, f"refusals_rank{env_rank()}.json"), "w") as f:
        json.dump({"refusals": found, "model_loaded": bool(loaded)}, f)
    launched.finish()
