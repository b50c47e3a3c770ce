"""jrt_prompt: JRT-Prompt (read the document twice before answering) and the reference's prompt builders.

Text only: nothing here is part of the model (a converted folder ships none of it). `repeat_to_fill`, which the
model's `"repeat"` prefix strategy uses, lives with the generation code and is re-exported here.
"""

from modeling_jrt.prefix_fill import repeat_to_fill

from .templates import (DOCUMENT_SEPARATOR, EXTRACTION_TEMPLATES, PROMPT_TEMPLATES, default_prompt, default_prompts,
                        find_answer, jrt_prompt, jrt_prompts, read_twice, truncate_context)

__all__ = ["DOCUMENT_SEPARATOR", "EXTRACTION_TEMPLATES", "PROMPT_TEMPLATES", "default_prompt", "default_prompts",
           "find_answer", "jrt_prompt", "jrt_prompts", "read_twice", "repeat_to_fill", "truncate_context"]
