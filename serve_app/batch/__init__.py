"""OpenAI's Batch API: uploaded files (``files``), batches and their durable state (``batches``),
and the runner that feeds a batch's lines through the gateway's own pipeline (``runner``)."""
