"""Natural-language prompts shared by the real-model engine and server tests."""

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "In 1969, the first human to walk on the moon was",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "Here is a list of fruits: apple, banana,",
    "Machine learning is a field of computer science that",
    "The Eiffel Tower is located in",
    "A haiku about autumn:",
    "If you multiply 7 by 8 you get",
]
