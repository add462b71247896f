"""llama.cpp's tokenizer and detokenizer, and its logging silenced for the process (the llamacpp engine)."""

from __future__ import annotations

import ctypes

_LOG_CALLBACK: list[object] = []  # installed once per process and never freed: llama.cpp keeps calling it


def quiet_logs() -> object:
    """llama.cpp's logging dropped, for the whole process. The callback outlives every engine: with one per engine,
    an engine collected after another was loaded left llama.cpp calling freed code (a crash at the next log line)."""
    import llama_cpp  # noqa: PLC0415

    if not _LOG_CALLBACK:
        @llama_cpp.llama_log_callback
        def _drop(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            return None

        llama_cpp.llama_log_set(_drop, ctypes.c_void_p(0))
        _LOG_CALLBACK.append(_drop)
    return _LOG_CALLBACK[0]


class Vocab:
    """llama.cpp's tokenizer and detokenizer (the TextStream's `decode`)."""

    def __init__(self, lib: object, vocab: object) -> None:
        self._lib, self._vocab = lib, vocab

    def tokenize(self, text: str, special: bool, add_special: bool = False) -> list[int]:
        """`text` as ids; `special`: control tokens spelled in it are parsed; `add_special`: the tokens the vocabulary
        adds around a prompt (BOS where the GGUF's add_bos_token says, EOS where add_eos_token does)."""
        lib: object = self._lib
        data = text.encode("utf-8")
        room = len(data) + 8
        for _ in range(2):
            buf = (lib.llama_token * room)()  # type: ignore[attr-defined]
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, room, add_special,  # type: ignore[attr-defined]
                                   special)
            if n >= 0:
                return list(buf[:n])
            room = -n
        raise ValueError("llama.cpp could not tokenize the text")

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)  # type: ignore[attr-defined]
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)  # type: ignore[attr-defined]
        return buf.raw[:n]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(int(t), not skip_special_tokens) for t in ids).decode("utf-8", errors="replace")
