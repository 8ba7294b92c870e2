"""Special-token roles every tokenizer is addressed by, and the tokenizer error type.

A pipeline never names a special id: it asks the tokenizer for a role's id (`pad_id`,
`special_ids["end_turn"]`). Kept apart from data/tokenizer.py so that the file tokenizers
(data/hf_tokenizers.py, loaded lazily by tokenizer.py) can share them without an import cycle.
"""

# Every tokenizer has the text roles; the image roles only with vision; the chat / tool roles
# belong to the chat and tool-call format (rl/chat_format.py): file tokenizers map or add
# them, the byte tokenizer carries them with chat=True.
TEXT_ROLES = ("pad", "bos", "eos")
CHAT_ROLES = ("system", "user", "assistant", "tool_call", "tool_result", "answer", "end_turn")
IMAGE_ROLES = ("image_start", "image_end", "image_pad")


class TokenizerError(ValueError):
  """A tokenizer that cannot be used: missing or corrupt file, unknown spec, a special
  token it names but does not hold. The message is one line naming the file or field."""
