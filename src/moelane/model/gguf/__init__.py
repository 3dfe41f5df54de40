"""GGUF files (llama.cpp's format) read as a model folder is: `moelane.load("model-Q4_K_M.gguf")`.

    file.py     the file (or a split file's parts) opened with the `gguf` package: metadata, and where every tensor lies
    hparams.py  the metadata as the config.json keys the families read
    tensors.py  the decoder's tensors under llama.cpp's names and layouts; each expert a byte slice of its layer's
                stacked tensors, read when the provider or the pager asks for it
    blocks.py   block-quantised types (Q8_0, Q4_0, K-quants, ...): held as their bytes, decoded by `gguf.quants`
    codes.py    Q8_0 / Q4_0 experts as moelane's int8 / int4 codes and scales, repacked without requantising
    vocab.py    the tokenizer and chat template from `tokenizer.ggml.*`

docs/gguf.md says what is read from where, and what is not read yet.
"""
