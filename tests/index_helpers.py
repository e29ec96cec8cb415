"""Shared by the index tests: a small topical corpus and a tiny BPE tokenizer trained on it.

A tiny tokenizer keeps index tests fast (the real SmolLM2 tokenizer is used by one test); a real trained
BPE (not a toy split) still exercises offsets, merges and the fingerprint.
"""

from __future__ import annotations

from pathlib import Path

from rasd.index import Document

TOPICS = {
    "rockets": "A rocket engine burns fuel and oxidizer to produce thrust. The first stage lifts the vehicle "
               "off the launch pad, and the second stage carries the payload into orbit around the Earth. ",
    "bread": "To bake bread, mix flour, water, salt and yeast into a dough. Knead the dough, let it rise for "
             "an hour, shape the loaf and bake it in a hot oven until the crust is brown. ",
    "cats": "Cats are small carnivorous mammals. A cat sleeps for most of the day, hunts mice at night and "
            "purrs when it is content. Kittens learn to hunt by watching their mother. ",
    "rivers": "A river flows from its source in the mountains down to the sea. Along the way it carves "
              "valleys, deposits sediment in its delta and floods the plains in spring. ",
    "chess": "Chess is a board game for two players. Each player starts with sixteen pieces; the goal is to "
             "checkmate the opposing king. The opening, middlegame and endgame need different plans. ",
    "volcano": "A volcano erupts when magma rises through the crust. Lava, ash and gas escape from the vent, "
               "and the cone grows with every eruption over thousands of years. ",
}


def topic_documents(repeat: int = 3) -> list[Document]:
    """One document per topic, its paragraph repeated so documents span several chunks."""
    return [Document(text=(text * repeat).strip(), source=f"mem://{name}", title=name.title())
            for name, text in TOPICS.items()]


def make_tiny_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """Train a byte-level BPE on the topic corpus and save it like a hub model (loadable by AutoTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(TOPICS.values()) * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return folder
