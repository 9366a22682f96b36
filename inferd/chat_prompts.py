"""Open chat questions shared by `inferd bench spec` (its "chat" task) and the draft-head training
(inferd.train), which keeps them and anything close to them out of its data: the bench then
measures the learned head on questions it never saw."""

CHAT_TASKS = (
    "What should I pack for a weekend hiking trip?",
    "How do I make a good cup of tea?",
    "Why is the sky blue?",
    "Give me some ideas for a birthday party for a seven-year-old.",
    "What is the difference between a virus and a bacterium?",
    "How can I get better at remembering names?",
)
