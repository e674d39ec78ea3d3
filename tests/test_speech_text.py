import pytest

from moekit.errors import ConfigError
from moekit.speech.text import CharVocab, error_rates, normalize


def test_normalize_english_and_other_languages():
    assert normalize("Mr. Smith has twenty-one apples (aside)!", "en") == "mister smith has 21 apples"
    assert normalize("  Ça va? Très   bien, Jürgen!", "fr") == "ça va très bien jürgen"  # diacritics kept


def test_error_rates_corpus_level_by_hand():
    refs, hyps = ["The cat sat.", "On the mat!"], ["the cat sit", "on mat"]
    r = error_rates(refs, hyps, "en")
    # words: 1 substitution (sat->sit) + 1 deletion (the) over 3 + 3 reference words
    assert r["wer"] == pytest.approx(2 / 6) and r["words"] == 6 and r["n"] == 2
    # chars (spaces count): 1 substitution (a->i) + 4 deletions ("the ") over 11 + 10 reference chars
    assert r["cer"] == pytest.approx(5 / 21) and r["chars"] == 21
    assert error_rates(refs, refs, "en")["wer"] == 0.0


def test_error_rates_empty_references():
    r = error_rates(["", "a b"], ["x y", "a b"], "de")  # an empty reference: its hypothesis is insertions
    assert r["wer"] == pytest.approx(2 / 2) and r["words"] == 2
    r = error_rates(["(noise)"], ["a b c"], "en")  # normalizes to "": denominator 1, no division by zero
    assert r["words"] == 0 and r["wer"] == 3.0
    assert error_rates(["(noise)"], [""], "en")["wer"] == 0.0
    assert error_rates([], [], "en")["n"] == 0
    with pytest.raises(ConfigError, match="2 references but 1 hypotheses"):
        error_rates(["a", "b"], ["a"], "en")


def test_char_vocab_encode_decode_round_trip():
    texts = [normalize(t, "fr") for t in ["Ça, bébé!", "abc cab"]]
    vocab = CharVocab.build(texts)
    assert vocab.chars == ("a", "b", "c", "ç", "é") and len(vocab) == 7
    assert vocab.encode("ab ca") == [2, 3, CharVocab.SPACE, 4, 2]
    for t in texts:
        assert vocab.decode(vocab.encode(t)) == t
    assert vocab.encode("zz abz  x c") == [2, 3, 1, 4]  # unknown characters dropped, no empty words
    assert CharVocab.from_json(vocab.to_json()) == vocab


def test_ctc_collapse_rules():
    vocab = CharVocab.build(["ab"])
    a, b, blank, space = 2, 3, CharVocab.BLANK, CharVocab.SPACE
    assert vocab.decode_ctc([a, a, blank, a]) == "aa"  # a blank separates a doubled letter
    assert vocab.decode_ctc([a, a, a]) == "a"  # repeats merge
    assert vocab.decode_ctc([blank, a, blank, blank, b, b, space, space, a, blank]) == "ab a"
    assert vocab.decode_ctc([space, a, space, space, blank, space]) == "a"  # no outer or doubled spaces
    assert vocab.decode_ctc([]) == ""


def test_char_vocab_json_errors():
    with pytest.raises(ConfigError, match="chars"):
        CharVocab.from_json('{"tokens": []}')
    with pytest.raises(ConfigError, match="distinct single"):
        CharVocab.from_json('{"chars": ["a", "a"]}')
