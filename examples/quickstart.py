import stratkit
from sklearn.datasets import load_digits

trainer = stratkit.Trainer()          # detects the cluster; creates the strategy first


def build_and_compile():
    import keras
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


d = load_digits()
x, y = (d.data / 16).astype("float32"), d.target

model = trainer.build(build_and_compile)                     # built inside strategy.scope()
trainer.fit(model, (x, y), epochs=10, per_replica_batch_size=32,
            backup_dir="backup")                             # resumes here after a crash
print(trainer.evaluate(model, (x, y), per_replica_batch_size=32))  # a dict, the same on every worker
trainer.save(model, "out/digits.keras")                      # only the chief writes it
