"""A small English text the test tokenizer is trained on (written for this project)."""

CORPUS = """\
The engine reads a prompt, splits it into tokens, and runs the model one step at a time.
Each step looks at every token that came before it and writes a little more of the answer.
When many people ask questions at once, the engine puts their requests into one batch, so the
graphics card does the work of many requests in a single pass. This is called batching, and it
is the main reason a serving engine is faster than a simple loop over requests.

A language model does not remember a conversation by itself. The serving engine keeps a cache of
keys and values for every token it has seen, and each new token only adds one row to that cache.
The cache lives in fixed slots of memory. A small table maps each request to the slots that hold
its tokens. When a request finishes, its slots go back to the free list and another request can
use them. If memory runs out, the newest requests wait in the queue until space is free again.

Adapters are small sets of extra weights that change what a model says without changing the model
itself. One adapter may write short answers about the weather, another may translate questions
into database queries, and a third may speak like a friendly teacher. A good server can hold many
adapters at the same time and mix requests for different adapters in the same batch.

Here is a short story. On a cold morning in the north, a girl named Mira walked to the harbour
with her father. The boats were painted red, blue and yellow, and the water was very still. Her
father pointed at a small white boat and said that it had carried letters between the islands for
forty years. Mira asked how a boat could be so old and still float. He laughed and told her that
every plank had been replaced at least twice, but the name on the side had never changed.

Numbers matter too: one, two, three, four, five, six, seven, eight, nine, ten, 11, 12, 100, 2024.
Times and prices look like 9:30, 10:45, $3.50 and 12.5%. Lists look like this: apples, pears,
plums; red, green, blue. Questions end with a question mark? Strong words end with a bang!

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

Good software is tested. Every test compares the result against a reference that is known to be
right, and a test that cannot fail proves nothing. Small models with random weights are useful in
tests because they run in a moment, but their weights must be chosen with care: if every word is
equally likely, two different programs will look the same even when one of them is wrong.

The weather today is sunny with a light wind from the west. Tomorrow there may be rain in the
afternoon, and the evening will be cool. People in the city carry umbrellas just in case, while
farmers in the valley hope for a long and steady rain that will help the fields grow green again.
"""
