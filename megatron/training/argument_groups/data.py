"""Data and tokenizer flags. `add_tokenizer_args` is shared with tools/preprocess_data.py;
this module imports neither torch nor the rest of megatron."""

from .builder import ArgGroup

TOKENIZER_TYPES = [
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
]

# Tokenizer types that older Megatron releases had and old scripts still name
# (arguments.parse_args turns them into a hint before argparse rejects the choice).
REMOVED_TOKENIZER_TYPES = {
    "Llama3Tokenizer": "use HuggingFaceTokenizer (--tokenizer-model <HF dir or name>) or "
    "TikTokenizer",
    "MistralTokenizer": "use HuggingFaceTokenizer (--tokenizer-model <HF dir or name>)",
    "HFTokenizer": "renamed to HuggingFaceTokenizer",
}


def _add_data_args(parser):
    g = ArgGroup(parser, "data and dataloader")
    g._add(
        "--data-path",
        default=None,
        nargs="*",
        help="Dataset prefixes for train/valid/test, split by --split: "
        '"PREFIX", "PREFIX1 PREFIX2 ..." (weighted by size) or "W1 PREFIX1 W2 PREFIX2 ...".',
    )
    g.str(
        "--phase-transition-iterations",
        None,
        "Comma-separated iterations at which the data blend moves to its next phase.",
    )
    g.str(
        "--split",
        None,
        'Train/valid/test proportions, e.g. "969,30,1" or "99/1/0" '
        "(default with --data-path: 969, 30, 1).",
    )
    for split, name in (("train", "training"), ("valid", "validation"), ("test", "test")):
        g._add(
            f"--{split}-data-path",
            default=None,
            nargs="*",
            help=f"Dataset prefixes for the {name} split only.",
        )
    g.str("--data-args-path", None, "File holding the --data-path value.")
    g.str(
        "--per-split-data-args-path",
        None,
        'JSON file with "train", "valid", "test" data-path lists.',
    )
    g._add(
        "--per-dataset-sequences-path",
        default=None,
        help="JSON file with the sequence count of each dataset (skips reading the indices).",
    )
    g._add(
        "--data-cache-path",
        default=None,
        help="Directory for the dataset index caches (default: next to the data).",
    )
    g.false(
        "--no-mmap-bin-files", "mmap_bin_files", "Read .bin files with file reads instead of mmap."
    )
    g.true("--mock-data", "Train on generated mock data instead of files.")
    g.int("--seq-length", None, "Sequence length of a training sample.")
    g.int("--encoder-seq-length", None, "Encoder sequence length (alternative to --seq-length).")
    g.int("--decoder-seq-length", None, "Decoder sequence length (T5).")
    g.float("--sample-rate", 1.0, "Fraction of the samples used (vision/audio datasets).")
    g.float("--mask-prob", 0.15, "Masking probability (BERT/T5).")
    g.float("--short-seq-prob", 0.1, "Probability of a short sample (BERT/T5).")
    g.int("--num-workers", 2, "DataLoader worker processes.")
    g.true("--reset-position-ids", "Restart position ids after each end-of-document token.")
    g.true("--reset-attention-mask", "Do not attend across end-of-document tokens.")
    g.true(
        "--dataloader-inter-document-masking",
        "Let the data loader mask attention across documents (packed sequences).",
    )
    g.true("--eod-mask-loss", "No loss on end-of-document tokens.")
    g.false(
        "--no-create-attention-mask-in-dataloader",
        "create_attention_mask_in_dataloader",
        "Do not build attention masks in the data loader.",
    )
    g.int("--num-dataset-builder-threads", 1, "Threads per rank building datasets.")
    g.str("--object-storage-cache-path", None, "Cache directory for object-storage datasets.")
    g.float("--mid-level-dataset-surplus", 0.005, "Sample surplus built for blended components.")
    g.true(
        "--allow-ambiguous-pad-tokens",
        "Treat every token equal to the pad id as padding "
        "even when the pad id collides with another special token.",
    )
    g.true("--dataloader-fast-cache-load", "Load cached dataset indices without checks.")
    g.true(
        "--dataloader-defer-npy-index-mmap",
        "Memory-map the cached indices only when first used.",
    )
    g.true("--fim-data", "Apply fill-in-the-middle transformations to samples.")
    g.float("--fim-rate", 0.5, "Probability of a FIM transformation.")
    g.float("--fim-spm-rate", 0.5, "Probability of SPM (vs PSM) ordering for FIM.")
    g.str("--fim-split-sample", None, "Token at which FIM splits samples.")
    g.float("--fim-fragment-rate", None, "FIM rate per fragment.")
    g.str("--fim-no-prefix", None, "Do not apply FIM to samples with this prefix.")
    for part, token in (
        ("prefix", "<fim_prefix>"),
        ("middle", "<fim_middle>"),
        ("suffix", "<fim_suffix>"),
        ("pad", "<fim_pad>"),
        ("eod", "<|endoftext|>"),
    ):
        g.str(f"--fim-{part}-token", token, f"FIM {part} token.")
    g.removed(
        ("--data-impl", "--dataset-impl"),
        "the .bin/.idx (mmap) dataset format is the only one; drop the flag",
    )
    return parser


def add_tokenizer_args(parser):
    """Add the 'tokenizer' group (also used by tools/preprocess_data.py). Returns the parser."""
    g = ArgGroup(parser, "tokenizer")
    g.int("--vocab-size", None, "Vocabulary size before padding (NullTokenizer).")
    g.int(
        "--padded-vocab-size",
        None,
        "Vocabulary size of the model; default: computed from "
        "the tokenizer and --make-vocab-size-divisible-by.",
    )
    g.no("pad-vocab-size", "Use the tokenizer vocabulary size as is.")
    g.str("--vocab-file", None, "Vocabulary file.")
    g.str("--merge-file", None, "BPE merges file.")
    g.int("--vocab-extra-ids", 0, "Extra sentinel tokens <extra_id_N> (T5 span masking).")
    g.str("--tokenizer-type", None, "Tokenizer.", choices=TOKENIZER_TYPES)
    g.str(
        "--tokenizer-model",
        None,
        "SentencePiece model, Hugging Face name/directory or tiktoken JSON.",
    )
    g.str("--tokenizer-metadata", None, "Tokenizer metadata JSON.", dest="metadata_path")
    g.list(
        "--tokenizer-special-tokens",
        None,
        "Special tokens to add to the tokenizer.",
        dest="special_tokens",
    )
    g.str("--tiktoken-pattern", None, "tiktoken pre-tokenization pattern.", choices=["v1", "v2"])
    g.int("--tiktoken-num-special-tokens", 1000, "Number of tiktoken special tokens.")
    g.removed("--tiktoken-special-tokens", "use --tokenizer-special-tokens")
    g.true("--tokenizer-sentencepiece-legacy", "SentencePiece tokenizer in legacy mode.")
    g.no(
        "tokenizer-sentencepiece-ignore-extra-whitespaces",
        "Keep repeated whitespace when tokenizing with SentencePiece.",
    )
    g.true("--tokenizer-hf-no-use-fast", "Use the slow (Python) Hugging Face tokenizer.")
    g.true(
        "--tokenizer-hf-no-include-special-tokens",
        "Do not add special tokens when encoding with a Hugging Face tokenizer.",
    )
    g.true("--trust-remote-code", "Let Hugging Face tokenizers run code from the model repo.")
    g.int("--null-tokenizer-eod-id", None, "End-of-document id of the NullTokenizer.")
    g.int("--null-tokenizer-pad-id", -1, "Pad id of the NullTokenizer.")
    g.str("--chat-template", None, "Chat template (Jinja) for conversation data.")
    g.true("--use-gigatoken", "Use the GigaToken tokenizer library.")
    return parser


# Megatron's name for the same group function.
_add_tokenizer_args = add_tokenizer_args


def _add_sft_args(parser):
    g = ArgGroup(parser, "sft")
    g.true("--sft", "Supervised fine-tuning on conversation data.")
    g.str("--sft-tokenizer-prompt-format", "nemotron-h-aligned", "SFT prompt format.")
    return parser
