"""Training the default pair (issue 48): a small Kimi K2-architecture target and its DFlash drafter,
trained on the Python standard library and written in the formats real checkpoints use.

The one command is ``python -m training.run`` (run.py).  This folder sits beside ``models/`` and
``bench/``, outside the ``torch_kdtree`` package: ``import torch_kdtree`` never imports it, and
installs do not ship it.  Modules, in pipeline order:

- corpus.py     the standard library's .py files, the hashed held-out split, the manifest
- tokenizer.py  byte-level BPE (tokenizers), saved for AutoTokenizer
- data.py       token streams and windows
- recipe.py     every size and step count, FULL (one H200) and TOY (CPU, the test)
- target.py     the training plan (torch forms of every layer), aux-free balancing, the loop
- quant.py      group-32 symmetric INT4: fake quantisation for QAT, compressed-tensors export
- export.py     the target (K2 config.json, INT4 safetensors, tokenizer) and the DFlash drafter
- drafter.py    continuations, taps, the many-block DFlash training forward and loss
- evaluate.py   bits per byte, expert load, greedy DDTree against autoregressive decoding
- card.py       the model card
"""
