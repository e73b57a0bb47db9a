"""Flags of Megatron's legacy task families: vision (ViT, DINO, inpainting) and the ICT/REALM
biencoder retriever. They parse so that old scripts keep their spelling; the flag policy
table says what happens when one is given."""

from .builder import ArgGroup


def _add_vision_args(parser):
    g = ArgGroup(parser, "vision")
    g.int("--num-classes", 1000, "Number of classes of the vision classification task.")
    g.int("--img-h", 224, "Image height.")
    g.int("--img-w", 224, "Image width.")
    g.int("--num-channels", 3, "Image channels.")
    g.int("--patch-dim", 16, "Patch size.")
    g.float("--classes-fraction", 1.0, "Fraction of the classes used for training.")
    g.float("--data-per-class-fraction", 1.0, "Fraction of the images per class used.")
    g.false(
        "--no-data-sharding", "data_sharding", "Do not shard the data over data-parallel ranks."
    )
    g.float("--head-lr-mult", 1.0, "Learning-rate multiplier of the classification head.")
    g.true("--vision-pretraining", "Run vision pretraining.")
    g.str(
        "--vision-pretraining-type",
        "classify",
        "Vision pretraining objective.",
        choices=["classify", "inpaint", "dino"],
    )
    g.str("--vision-backbone-type", "vit", "Vision backbone.", choices=["vit", "mit", "swin"])
    g.str("--swin-backbone-type", "tiny", "Swin backbone size.", choices=["tiny", "base", "h3"])
    g.str("--mask-type", "random", "Inpainting mask type.", choices=["random", "row"])
    g.float("--mask-factor", 1.0, "Inpainting mask size factor.")
    g.int("--iter-per-epoch", 1250, "Iterations per epoch (vision schedules).")
    g.int("--dino-local-img-size", 96, "DINO: size of the local crops.")
    g.int("--dino-local-crops-number", 10, "DINO: local crops per image.")
    g.int("--dino-head-hidden-size", 2048, "DINO: hidden size of the projection head.")
    g.int("--dino-bottleneck-size", 256, "DINO: bottleneck size of the projection head.")
    g.float("--dino-freeze-last-layer", 1, "DINO: epochs during which the last layer is frozen.")
    g.true("--dino-norm-last-layer", "DINO: weight-normalize the last layer.")
    g.float("--dino-warmup-teacher-temp", 0.04, "DINO: initial teacher temperature.")
    g.float("--dino-teacher-temp", 0.07, "DINO: final teacher temperature.")
    g.int("--dino-warmup-teacher-temp-epochs", 30, "DINO: epochs of teacher-temperature warm-up.")
    return parser


def _add_biencoder_args(parser):
    g = ArgGroup(parser, "biencoder")
    g.int("--ict-head-size", None, "Size of the ICT/REALM retrieval head.")
    g.int("--biencoder-projection-dim", 0, "Projection size of the biencoder (0: none).")
    g.true(
        "--biencoder-shared-query-context-model",
        "One model encodes both queries and contexts.",
    )
    g.str("--ict-load", None, "Directory of the ICT checkpoint to load.")
    g.str("--bert-load", None, "Directory of the BERT checkpoint to start from.")
    g.str("--titles-data-path", None, "Dataset prefix of the document titles.")
    g.float("--query-in-block-prob", 0.1, "Probability that the query stays in its block.")
    g.true("--use-one-sent-docs", "Keep one-sentence documents.")
    g.str("--evidence-data-path", None, "Evidence dataset (a TSV file).")
    g.list(
        "--retriever-report-topk-accuracies",
        [],
        "Top-k retrieval accuracies to report.",
        type=int,
    )
    g.true("--retriever-score-scaling", "Scale retrieval scores by 1/sqrt(hidden size).")
    g.str("--block-data-path", None, "Where the block data is written or read.")
    g.str("--embedding-path", None, "Where the block embeddings are written or read.")
    g.int("--indexer-batch-size", 128, "Batch size of the indexing job.")
    g.int("--indexer-log-interval", 1000, "Batches between indexing progress reports.")
    return parser
