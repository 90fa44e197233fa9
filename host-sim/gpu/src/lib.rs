//! Model of a GPU LLM server.
